"""Fixtures shared by every test module."""

from __future__ import annotations

from typing import Any

import pytest
from support import make_state


@pytest.fixture
def state() -> dict[str, Any]:
    return make_state(0)
