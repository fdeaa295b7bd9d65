"""Turn a user's root (a local path or an fsspec URL) into a backend."""

from __future__ import annotations

from typing import Any

from fsspec.utils import get_protocol

from dcp_safe.storage.backend import Backend
from dcp_safe.storage.fsspec_backend import FsspecBackend
from dcp_safe.storage.local_backend import LocalBackend
from dcp_safe.storage.retry import RetryPolicy
from dcp_safe.storage.retrying_backend import RetryingBackend, single_try_s3_options

__all__ = ["open_backend"]

_S3_PROTOCOLS = frozenset({"s3", "s3a"})


def open_backend(
    root: str,
    storage_options: dict[str, Any] | None = None,
    *,
    fsync: bool = True,
    retry: RetryPolicy | None = None,
) -> Backend:
    """Pick the backend for a root.

    Local paths and ``file://`` URLs get the POSIX backend. S3 gets fsspec behind
    :class:`RetryingBackend`: the clients try each request once with bounded timeouts and the
    policy owns retries and the deadline (s3fs and botocore stacked would take ~40 s to report
    a persistent fault). Anything else goes to fsspec as it is.
    """
    root = str(root)
    protocol = get_protocol(root)
    if protocol in ("file", "local"):
        return LocalBackend(root, fsync=fsync)
    if protocol in _S3_PROTOCOLS:
        inner = FsspecBackend(root, single_try_s3_options(storage_options), client_retries=1)
        return RetryingBackend(inner, retry or RetryPolicy())
    return FsspecBackend(root, storage_options)
