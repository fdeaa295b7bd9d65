"""Any fsspec file system (``memory://``, ``s3://``, ...) behind the backend protocol.

Object stores cannot rename atomically, so this backend reports ``supports_atomic_rename=False``
and the committer publishes by writing the ``_COMMITTED`` marker last. A streamed write that
fails is discarded, never closed: closing an fsspec buffered file flushes and publishes whatever
was written (for s3fs, a partial multipart upload becomes a visible object).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from dcp_safe.errors import StorageError
from dcp_safe.storage.backend import Backend, WritableFile

__all__ = ["FsspecBackend"]


class FsspecBackend(Backend):
    """A root on any fsspec file system, addressed by URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        fs, root = url_to_fs(url, **self.storage_options)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root = root.rstrip("/")
        # Exclusive create must be a real conditional write on the server, not check-then-write.
        self.supports_exclusive_create = bool(getattr(fs, "_supports_exclusive_create", False))

    def _abs(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _fail(self, op: str, rel: str, exc: BaseException) -> StorageError:
        return StorageError(op, self.full_path(rel), exc)

    @contextmanager
    def open_write(self, rel: str) -> Iterator[WritableFile]:
        try:
            f = self.fs.open(self._abs(rel), "wb")
        except OSError as exc:
            raise self._fail("create", rel, exc) from exc
        try:
            yield f
        except BaseException:
            _discard(f)
            self._remove_quietly(rel)
            raise
        try:
            f.close()
        except OSError as exc:
            self._remove_quietly(rel)
            raise self._fail("write", rel, exc) from exc

    @contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        with self.fs.open(self._abs(rel), "rb") as f:
            yield f

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive and not self.supports_exclusive_create and self.exists(rel):
            # Best effort only: such a backend says so through its capability flag.
            raise FileExistsError(self.full_path(rel))
        try:
            self.fs.pipe_file(self._abs(rel), data)
        except FileExistsError:
            raise
        except OSError as exc:
            raise self._fail("write", rel, exc) from exc

    def read_bytes(self, rel: str) -> bytes:
        data: bytes = self.fs.cat_file(self._abs(rel))
        return data

    def size(self, rel: str) -> int:
        return int(self.fs.size(self._abs(rel)))

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._abs(rel)))

    def is_dir(self, rel: str) -> bool:
        return bool(self.fs.isdir(self._abs(rel)))

    def list_dir(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self._abs(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        prefix = self._abs(rel).rstrip("/") + "/"
        names = {str(e).rstrip("/").removeprefix(prefix).split("/")[0] for e in entries}
        return sorted(n for n in names if n)

    def makedirs(self, rel: str) -> None:
        try:
            self.fs.makedirs(self._abs(rel), exist_ok=True)
        except OSError as exc:
            raise self._fail("mkdir", rel, exc) from exc

    def remove_tree(self, rel: str) -> None:
        try:
            if self.fs.exists(self._abs(rel)):
                self.fs.rm(self._abs(rel), recursive=True)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._fail("remove", rel, exc) from exc

    def _remove_quietly(self, rel: str) -> None:
        with suppress(OSError, ValueError):
            self.fs.rm_file(self._abs(rel))


def _discard(f: Any) -> None:
    """Drop a half-written fsspec file without publishing it."""
    discard = getattr(f, "discard", None)
    if callable(discard):
        discard()
    else:
        f.closed = True  # AbstractBufferedFile: mark closed so close() never flushes
