"""Fixtures shared by every test module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
from support import make_state


@pytest.fixture
def state() -> dict[str, Any]:
    return make_state(0)


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh ``memory://`` root: storage without atomic rename, cleaned up afterwards."""
    url = f"memory://dcp-safe-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)
