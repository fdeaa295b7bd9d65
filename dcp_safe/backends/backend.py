"""A small byte protocol over one storage root, with capability flags.

Higher layers (writer, reader, committer) speak only this protocol and choose their commit
strategy from the flags — ``supports_atomic_rename`` and ``supports_exclusive_create`` — never
from the concrete file system type. Paths are ``/``-separated and relative to the root, so the
on-storage layout is the same on a local disk and an object store.

Every lower-layer ``OSError`` is mapped once, here, to :class:`~dcp_safe.errors.StorageError`
naming the operation and the full path. ``FileNotFoundError`` is left as it is: callers turn it
into the error that fits (a missing checkpoint, a missing shard).

Call order and threads: a backend is used from the training thread and from writer threads at
once; implementations hold no per-call state and must be safe for concurrent calls on different
paths. Backends are pickled into DCP's process-based async executor, so they hold no open handles.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO

from dcp_safe.manifest.streams import WritableFile

__all__ = ["Backend", "WritableFile"]


class Backend(abc.ABC):
    """One storage root.

    Attributes:
        url: the root as the user gave it (a local path or an fsspec URL), for messages.
        supports_atomic_rename: a whole directory can be renamed into place atomically, and a
            rename never replaces an existing non-empty directory unless asked to.
        supports_exclusive_create: :meth:`write_bytes` with ``exclusive=True`` fails, atomically,
            when the object already exists.
    """

    url: str
    supports_atomic_rename: bool = False
    supports_exclusive_create: bool = False

    def full_path(self, rel: str) -> str:
        """The path or URL of ``rel``, for messages and for users."""
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    @abc.abstractmethod
    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        """Stream a new file. It becomes visible, durably, only if the ``with`` block succeeds;
        on an exception nothing is left under ``rel``."""

    @abc.abstractmethod
    def open_read(self, rel: str) -> AbstractContextManager[BinaryIO]:
        """A seekable binary reader. Raises FileNotFoundError when absent."""

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file durably. With ``exclusive``, raise FileExistsError if present."""

    def read_bytes(self, rel: str) -> bytes:
        """A whole small file. Raises FileNotFoundError when absent."""
        with self.open_read(rel) as f:
            return f.read()

    @abc.abstractmethod
    def size(self, rel: str) -> int:
        """Size in bytes. Raises FileNotFoundError when absent."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""

    def walk_files(self, rel: str) -> Iterator[str]:
        """Every file under ``rel``, as paths relative to ``rel``."""
        for name in self.list_dir(rel):
            child = f"{rel}/{name}" if rel else name
            if self.is_dir(child):
                yield from (f"{name}/{sub}" for sub in self.walk_files(child))
            else:
                yield name

    @abc.abstractmethod
    def is_dir(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None: ...

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Remove ``rel`` and everything under it; no error when absent."""

    def remove_file(self, rel: str) -> None:
        """Remove one file; no error when absent."""
        self.remove_tree(rel)

    def sync_dir(self, rel: str) -> None:  # noqa: B027 - a no-op is right where there are no dirs
        """Make directory entries under ``rel`` durable (no-op where that has no meaning)."""

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        """Atomically rename directory ``src`` to ``dst``.

        Only for backends with ``supports_atomic_rename``. Without ``replace``, raises
        FileExistsError if ``dst`` exists. With ``replace``, an existing ``dst`` is swapped out
        atomically and its new location is returned, for the caller to remove.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot rename directories atomically")
