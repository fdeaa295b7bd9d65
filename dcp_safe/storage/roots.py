"""Turn a user's root (a local path or an fsspec URL) into a backend."""

from __future__ import annotations

from typing import Any

from fsspec.utils import get_protocol

from dcp_safe.storage.backend import Backend
from dcp_safe.storage.fsspec_backend import FsspecBackend
from dcp_safe.storage.local_backend import LocalBackend

__all__ = ["open_backend"]


def open_backend(
    root: str, storage_options: dict[str, Any] | None = None, *, fsync: bool = True
) -> Backend:
    """Local paths and ``file://`` URLs get the POSIX backend; anything else goes to fsspec."""
    root = str(root)
    if get_protocol(root) in ("file", "local"):
        return LocalBackend(root, fsync=fsync)
    return FsspecBackend(root, storage_options)
