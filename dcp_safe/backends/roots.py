"""Turn a user's root (a local path or an fsspec URL) into a backend.

``faulty://`` roots (:mod:`dcp_safe.testing.faulty_fs`, a fault-injecting wrapper) get the
backend the storage they wrap would get, minus what only a real POSIX path can do: a faulty
local root goes through fsspec (no ``renameat2``, no fsync: the faults must reach every
operation, and LocalBackend calls ``os`` directly), a faulty S3 root keeps the retry layer and
its conditional puts (the wrapper builds an S3 target with single-try client settings itself).
"""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.utils import get_protocol

from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.backends.retry import RetryingBackend, RetryPolicy, single_try_s3_options
from dcp_safe.errors import ConfigError
from dcp_safe.topology import RootLike, as_root
from dcp_safe.untrusted import shown

_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# By name, so that opening a root never imports the testing package unless a faulty root asks.
fsspec.register_implementation(
    "faulty", "dcp_safe.testing.faulty_fs.FaultyFileSystem", clobber=False
)


def open_backend(
    root: RootLike,
    storage_options: dict[str, Any] | None = None,
    *,
    fsync: bool = True,
    retry: RetryPolicy | None = None,
) -> Backend:
    """Pick the backend for a root: a Root, or a path or URL and its ``storage_options``.

    Local paths and ``file://`` URLs get the POSIX backend; S3 (also under a wrapper) gets
    fsspec behind :class:`RetryingBackend` with single-try clients (stacked, s3fs and botocore
    would take ~40 s to report a persistent fault); anything else, fsspec as it is.

    Raises:
        ConfigError: no fsspec file system is installed for the URL's protocol; options both
            inside a Root and beside it.
    """
    root = as_root(root, storage_options)
    url, protocol = root.url, get_protocol(root.url)
    if protocol in ("file", "local"):
        return LocalBackend(url, fsync=fsync)
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        raise ConfigError(
            f"no storage for {shown(url, 200)}: {shown(exc, 200)}; give a local path or a"
            " URL of an installed fsspec file system, e.g. s3://bucket/prefix"
        ) from None
    options = root.storage_options
    options = single_try_s3_options(options) if protocol in _S3_PROTOCOLS else dict(options or {})
    backend = FsspecBackend(url, options, client_retries=1)
    return RetryingBackend(backend, retry or RetryPolicy()) if backend.s3 else backend
