"""Fixtures shared by every test module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
from support import make_state

# The S3 fixtures (s3, s3_bucket, s3_options, s3_root, proxy) are registered once, here, for every
# module: a module asks for them by parameter name and imports nothing.
pytest_plugins = ["s3_fixtures"]


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
