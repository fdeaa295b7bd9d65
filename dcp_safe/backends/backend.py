"""A small byte protocol over one storage root, with capability flags.

Higher layers speak only this protocol and choose their commit strategy from the flags
(``supports_atomic_rename``, ``supports_exclusive_create``), never from the file system type.
Paths are ``/``-separated and relative to the root, so the on-storage layout is the same on a
local disk and an object store.

Every lower-layer ``OSError`` is mapped once, here, to :class:`~dcp_safe.errors.StorageError`
naming the operation and the full path; ``FileNotFoundError`` is left as it is, for callers to
turn into the error that fits. A backend is used from several threads at once (safe for
concurrent calls on different paths) and pickled into DCP's process-based executor, so it holds
no per-call state and no open handles.
"""

from __future__ import annotations

import abc
import contextlib
import errno
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Literal, NoReturn

from dcp_safe.errors import CheckpointCorruptError, StorageError
from dcp_safe.manifest.streams import WritableFile

#: The most folders :meth:`Backend.walk_files` descends (dcp_safe writes two: ``<name>/_ranks/``).
MAX_WALK_DEPTH = 16


@dataclass(frozen=True)
class FileStat:
    # "link": a symbolic link, never followed (local roots); "other": a FIFO, a device...
    kind: Literal["file", "directory", "link", "other"]
    size_bytes: int  # 0 for anything but a file


def unwrapped(backend: Backend) -> Backend:
    """The backend under any wrappers that name it ``inner`` (RetryingBackend)."""
    while isinstance(inner := getattr(backend, "inner", None), Backend):
        backend = inner
    return backend


def too_deep(path: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        path,
        f"folders nested more than {MAX_WALK_DEPTH} deep: dcp_safe never writes such a tree,"
        " so it does not walk it; remove it by hand if it is not yours",
    )


def not_a_file(path: str, kind: str) -> CheckpointCorruptError:
    what = {
        "directory": "a directory",
        "link": "a symbolic link, which dcp_safe never follows beneath its root",
    }.get(kind, "a FIFO, a device or a socket")
    return CheckpointCorruptError(path, f"not a regular file ({what})")


def _over_limit(path: str, max_bytes: int, size: str = "") -> CheckpointCorruptError:
    return CheckpointCorruptError(path, f"{size}over the {max_bytes}-byte limit for this file")


class Backend(abc.ABC):
    """One storage root.

    Attributes:
        url: the root as the user gave it (a local path or an fsspec URL), for messages.
        supports_atomic_rename: a whole directory can be renamed into place atomically, and a
            rename never replaces an existing non-empty directory unless asked to.
        supports_exclusive_create: :meth:`write_bytes` with ``exclusive=True`` fails, atomically,
            when the object already exists. Where only the server can tell (an S3-compatible
            server may ignore ``If-None-Match``), the backend probes it the first time the flag
            is read (which may then raise :class:`~dcp_safe.errors.StorageError`).
        process_local: the store lives in this process's memory (fsspec's ``memory://``): no
            other process (a checkpoint worker) sees what is written there.
    """

    url: str
    supports_atomic_rename: bool = False
    supports_exclusive_create: bool = False
    process_local: bool = False

    def full_path(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def _fail(self, op: str, rel: str, exc: BaseException) -> StorageError:
        return StorageError(op, self.full_path(rel), exc)

    @contextlib.contextmanager
    def _failing(self, op: str, rel: str, *, absent: bool = False) -> Iterator[None]:
        """Any ``OSError`` in the block becomes :meth:`_fail`'s; with ``absent``, one that says
        ``rel`` is absent (a path under a file too, as on an object store) is raised as
        ``FileNotFoundError``."""
        try:
            yield
        except OSError as exc:
            if not absent or not isinstance(exc, FileNotFoundError | NotADirectoryError):
                raise self._fail(op, rel, exc) from exc
            if isinstance(exc, FileNotFoundError):
                raise
            raise FileNotFoundError(errno.ENOENT, "no such file", self.full_path(rel)) from exc

    def _raise_write_error(self, rel: str, exc: BaseException) -> NoReturn:
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise self._fail("write", rel, exc) from exc
        raise exc

    @abc.abstractmethod
    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        """Stream a new file. It becomes visible, durably, only if the ``with`` block succeeds;
        on an exception nothing is left under ``rel``."""

    @abc.abstractmethod
    def open_read(self, rel: str) -> AbstractContextManager[BinaryIO]:
        """A seekable binary reader. Raises FileNotFoundError when absent, and
        :class:`~dcp_safe.errors.CheckpointCorruptError` where the backend can tell that ``rel``
        is not a regular file (it never blocks on a FIFO)."""

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file durably. With ``exclusive``, raise FileExistsError if present."""

    def read_bytes(self, rel: str) -> bytes:
        with self.open_read(rel) as f:
            return f.read()

    def stat(self, rel: str) -> FileStat:
        # Files and directories only; backends that can meet other kinds (a FIFO) say so.
        return FileStat("directory", 0) if self.is_dir(rel) else FileStat("file", self.size(rel))

    def read_small(self, rel: str, max_bytes: int) -> bytes:
        """A whole control file (a marker, a manifest, a lease), read only if it is a regular
        file of at most ``max_bytes``: a directory, a FIFO, a device or an oversized file under
        a control file's name is refused (CheckpointCorruptError), never read or waited on."""
        found = self.stat(rel)
        if found.kind != "file":
            raise not_a_file(self.full_path(rel), found.kind)
        if found.size_bytes > max_bytes:
            raise _over_limit(self.full_path(rel), max_bytes, f"{found.size_bytes} bytes, ")
        with self.open_read(rel) as f:
            # The buffer is the file's size (one of max_bytes + 1 would be the whole cap per
            # file); it is read on to the cap only if the file grew since the stat.
            data = f.read(found.size_bytes + 1)
            if len(data) > found.size_bytes:
                data += f.read(max_bytes + 1 - len(data))
        if len(data) > max_bytes:
            raise _over_limit(self.full_path(rel), max_bytes)
        return bytes(data)

    @abc.abstractmethod
    def size(self, rel: str) -> int: ...

    def sizes(self, rel: str) -> dict[str, int]:
        """The size of every regular file directly under the folder ``rel``, by name, from one
        listing where the storage lists sizes (empty when absent). A listing is a snapshot: a
        caller that finds a name missing and must be sure asks :meth:`size` for it."""
        found: dict[str, int] = {}
        for name in self.list_dir(rel):
            with contextlib.suppress(FileNotFoundError):  # removed while we looked
                entry = self.stat(f"{rel}/{name}" if rel else name)
                if entry.kind == "file":
                    found[name] = entry.size_bytes
        return found

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""

    def walk_files(self, rel: str) -> Iterator[str]:
        """Every file under ``rel``, as paths relative to ``rel``. At most
        :data:`MAX_WALK_DEPTH` folders deep: a deeper tree is not one dcp_safe wrote, and raises
        CheckpointCorruptError naming it (never a ``RecursionError``), for a caller to pass by."""
        pending = [("", 0)]
        while pending:
            sub, depth = pending.pop()
            folder = f"{rel}/{sub}".strip("/") if rel else sub.strip("/")
            for name in self.list_dir(folder):
                child = f"{folder}/{name}" if folder else name
                if not self.is_dir(child):
                    yield f"{sub}{name}"
                elif depth >= MAX_WALK_DEPTH:
                    raise too_deep(self.full_path(child))
                else:
                    pending.append((f"{sub}{name}/", depth + 1))

    def entries_holding(self, member: str, *, unless: str | None = None) -> list[str]:
        """The names directly under the root that hold the file ``<name>/<member>`` (the
        commit marker: which entries may be checkpoints), sorted; with ``unless``, not those
        that also hold ``<name>/<unless>`` (a checkpoint in the trash). An object store answers
        from one walk (a request per 1,000 keys), not a request per entry."""
        found = [e for e in self.list_dir("") if self.exists(f"{e}/{member}")]
        return [e for e in found if unless is None or not self.exists(f"{e}/{unless}")]

    @abc.abstractmethod
    def is_dir(self, rel: str) -> bool: ...

    def modified_at(self, rel: str) -> float | None:
        """The newest modification time (storage's clock, seconds since the epoch) of the file
        ``rel`` or of any file under it; None when nothing is there or the backend cannot tell.
        """
        return None

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None: ...

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Remove ``rel`` and everything under it; no error when absent."""

    def remove_file(self, rel: str) -> None:
        self.remove_tree(rel)

    def remove_empty_dir(self, rel: str) -> bool:
        """Remove the folder ``rel`` if it is empty, atomically (nothing written into it
        meanwhile is lost); True when removed. Storage without real folders has no empty one."""
        return False

    def sync_dir(self, rel: str) -> None:  # noqa: B027 - a no-op is right where there are no dirs
        """Make directory entries under ``rel`` durable."""

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        """Atomically rename directory ``src`` to ``dst`` (``supports_atomic_rename`` only).
        Without ``replace``, FileExistsError if ``dst`` exists; with it, an existing ``dst`` is
        swapped out atomically and its new location returned, for the caller to remove."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename directories atomically")
