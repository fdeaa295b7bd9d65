"""POSIX backend: plain ``os`` calls beneath the root, fsync, and ``renameat2`` for publishing.

fsspec's ``LocalFileSystem`` would work, but its ``mv`` is not a single ``rename(2)`` and it
hides ``fileno()``; a commit needs exactly rename, fsync of files and of the parent directory.
Every path is resolved by :class:`~dcp_safe.backends.beneath.Beneath`, never through a link.
Files are replaced by a rename, never rewritten in place, so a file with other hard links is
never written through; an append (the history) refuses such a file. How ``renameat2`` publishes
and why plain ``rename(2)`` may not replace: docs/architecture.md, "How a root publishes".

Durable files start their writeback early (:class:`WritebackFile`): ``sync_file_range(
SYNC_FILE_RANGE_WRITE)`` every few MiB starts it without waiting (as RocksDB's
``bytes_per_sync``), so the closing ``fsync`` waits for the tail only (docs/benchmarks.md,
"Durable commit against the raw write floor"). Linux only; elsewhere, or once a file system
refuses it for a file, the fsync alone does the work.
"""

from __future__ import annotations

import ctypes
import errno
import io
import logging
import math
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, BinaryIO, Literal

from dcp_safe import layout
from dcp_safe.backends.backend import Backend, FileStat, not_a_file
from dcp_safe.backends.beneath import Beneath
from dcp_safe.errors import CheckpointCorruptError, StorageError
from dcp_safe.manifest.streams import WritableFile
from dcp_safe.untrusted import shown

log = logging.getLogger(__name__)

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _libc(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None


def _renameat2(src_dir: int, src: str, dst_dir: int, dst: str, flags: int) -> bool:
    """True when renameat2 did the job; False when it is unavailable here."""
    if (func := _libc("renameat2")) is None:
        return False
    if func(src_dir, os.fsencode(src), dst_dir, os.fsencode(dst), ctypes.c_uint(flags)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


class LocalBackend(Backend):
    supports_atomic_rename = True
    supports_exclusive_create = True

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.url = root
        self.root = os.path.abspath(root.removeprefix("file://"))
        self.fsync = fsync
        self._beneath = Beneath(self.root)

    def _fail(self, op: str, rel: str, exc: BaseException) -> StorageError:
        return StorageError(op, self._beneath.path(rel), exc)

    @contextmanager
    def open_write(self, rel: str) -> Iterator[WritableFile]:
        with ExitStack() as stack:
            # A link on the way is refused as it is (corrupt, not an OSError).
            with self._failing("create", rel):
                folder, name = stack.enter_context(self._beneath.parent(rel))
                fd = self._beneath.open_in(folder, name, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            f = stack.enter_context(os.fdopen(fd, "wb"))  # closed before its folder
            try:
                yield WritebackFile(f) if self.fsync else f
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            except BaseException as exc:
                with suppress(OSError):
                    os.unlink(name, dir_fd=folder)
                self._raise_write_error(rel, exc)

    def open_read(self, rel: str) -> BinaryIO:
        return self._open_file(rel, os.O_RDONLY, "rb")

    def _open_file(
        self, rel: str, flags: int, mode: Literal["rb", "a+b"], *, sole_link: bool = False
    ) -> BinaryIO:
        # Refused unless a regular file (with ``sole_link``: with no other hard link, a name
        # for a file outside the root). Opened non-blocking: a FIFO under a checkpoint's name
        # must not hang the caller; the fstat then refuses it (or a device such as /dev/zero).
        fd = self._beneath.open(rel, flags | os.O_NONBLOCK)
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise not_a_file(self._beneath.path(rel), _kind(found.st_mode))
            if sole_link and found.st_nlink > 1:
                raise CheckpointCorruptError(
                    self._beneath.path(rel),
                    f"has {found.st_nlink} hard links: it may be a file outside the root, and"
                    " dcp_safe appends only to its own; remove it (the history restarts empty)",
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, mode)
        except BaseException:
            os.close(fd)
            raise

    def _entries(self, rel: str) -> dict[str, int | None]:
        # The names in the folder ``rel``, each with its size if it is a regular file (no link
        # followed). None when absent or behind a link, or under a file: nothing is beneath.
        found: dict[str, int | None] = {}
        try:
            with self._beneath.folder(rel) as fd, os.scandir(fd) as entries:
                for entry in entries:
                    found[entry.name] = None
                    with suppress(FileNotFoundError):  # removed while we looked
                        if entry.is_file(follow_symlinks=False):
                            found[entry.name] = entry.stat(follow_symlinks=False).st_size
        except (FileNotFoundError, NotADirectoryError, CheckpointCorruptError):
            return {}
        except OSError as exc:
            raise self._fail("list", rel, exc) from exc
        return found

    def sizes(self, rel: str) -> dict[str, int]:
        return {name: size for name, size in self._entries(rel).items() if size is not None}

    def list_dir(self, rel: str) -> list[str]:
        return sorted(self._entries(rel))

    def stat(self, rel: str) -> FileStat:
        found = self._beneath.lstat(rel)
        kind = _kind(found.st_mode)
        return FileStat(kind, found.st_size if kind == "file" else 0)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        # Written aside, then linked in: ranks poll a folder and read a report or marker as
        # soon as its name shows, so it shows whole; a link, unlike a rename, refuses a name
        # that exists (an exclusive create stays one). A name that exists is otherwise renamed
        # over: a link or a file with other hard links there is replaced, never written through.
        try:
            with self._beneath.parent(rel) as (folder, name):
                temp = layout.temp_file_name(name)
                try:
                    self._write_new(folder, temp, rel, data)
                    os.link(temp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
                except FileExistsError:
                    if exclusive:
                        raise
                    os.rename(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
                    if self.fsync:
                        os.fsync(folder)  # the new name is as durable as the old one was
                finally:
                    with suppress(OSError):
                        os.unlink(temp, dir_fd=folder)
        except (FileExistsError, StorageError):
            raise
        except OSError as exc:
            raise self._fail("create", rel, exc) from exc

    def _write_new(self, folder: int, name: str, rel: str, data: bytes) -> None:
        fd = self._beneath.open_in(folder, name, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        except OSError as exc:
            raise self._fail("write", rel, exc) from exc
        finally:
            os.close(fd)

    def open_append(self, rel: str) -> BinaryIO:
        """``rel`` opened to append to (created if absent); CheckpointCorruptError when it is
        not a regular file, has other hard links (a name for a file outside the root), or lies
        under a link."""
        self.makedirs("")
        return self._open_file(rel, os.O_RDWR | os.O_APPEND | os.O_CREAT, "a+b", sole_link=True)

    def size(self, rel: str) -> int:
        found = self._beneath.lstat(rel)
        if stat.S_ISLNK(found.st_mode):
            raise not_a_file(self._beneath.path(rel), "link")
        return found.st_size

    def _lstat(self, rel: str) -> os.stat_result | None:
        # None when absent, or behind a link (nothing of it is beneath the root).
        with self._failing("stat", rel), suppress(FileNotFoundError, CheckpointCorruptError):
            return self._beneath.lstat(rel)
        return None

    def exists(self, rel: str) -> bool:
        return self._lstat(rel) is not None

    def is_dir(self, rel: str) -> bool:
        found = self._lstat(rel)
        return found is not None and stat.S_ISDIR(found.st_mode)

    def modified_at(self, rel: str) -> float | None:
        with self._failing("stat", rel), suppress(FileNotFoundError):
            found = self._beneath.lstat(rel)
            newest = found.st_mtime_ns
            if stat.S_ISDIR(found.st_mode):
                for fd, _, name in self._beneath.walk(rel):
                    with suppress(FileNotFoundError):  # removed while we looked
                        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        newest = max(newest, found.st_mtime_ns)
            return newest / 1e9
        return None

    def walk_files(self, rel: str) -> Iterator[str]:
        found: list[str] = []
        # Absent, behind a link or removed since: nothing to walk (a tree too deep still raises).
        if self.is_dir(rel):
            with self._failing("list", rel), suppress(FileNotFoundError, NotADirectoryError):
                found = sorted(path for _, path, _ in self._beneath.walk(rel))
        yield from found

    def makedirs(self, rel: str) -> None:
        with self._failing("mkdir", rel):
            os.makedirs(self.root, exist_ok=True)  # the root as given (links followed)
            with self._beneath.folder(rel, create=True):
                pass

    def remove_tree(self, rel: str) -> None:
        with self._failing("remove", rel):
            self._beneath.remove(rel)

    def remove_empty_dir(self, rel: str) -> bool:
        try:  # one rmdir: nothing written into it meanwhile is lost
            with self._beneath.parent(rel) as (folder, name):
                os.rmdir(name, dir_fd=folder)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise self._fail("remove", rel, exc) from exc
        return True

    def sync_dir(self, rel: str) -> None:
        if self.fsync:
            with self._failing("fsync", rel), self._beneath.folder(rel) as fd:
                os.fsync(fd)

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        dst_path = self._beneath.path(dst)
        src_parent, dst_parent = self._beneath.parent(src), self._beneath.parent(dst)
        try:
            with src_parent as (src_dir, src_name), dst_parent as (dst_dir, dst_name):
                if replace and _present(dst_dir, dst_name):
                    if _renameat2(src_dir, src_name, dst_dir, dst_name, _RENAME_EXCHANGE):
                        return src  # the old checkpoint now lives where the partial was
                    # Two plain renames would leave the name empty if we died between them.
                    raise StorageError(
                        "replace",
                        dst_path,
                        "this file system cannot swap directories atomically (renameat2"
                        " RENAME_EXCHANGE); the existing checkpoint is untouched - save under a"
                        " new name instead",
                    )
                if not _renameat2(src_dir, src_name, dst_dir, dst_name, _RENAME_NOREPLACE):
                    if _present(dst_dir, dst_name):
                        raise FileExistsError(errno.EEXIST, "exists", dst_path)
                    os.rename(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        except (FileExistsError, StorageError):
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "exists", dst_path) from exc
            raise self._fail("rename", src, exc) from exc
        return None

    def entries_holding(self, member: str, *, unless: str | None = None) -> list[str]:
        # One listing of the root, then one lstat per entry: cheap on a local disk. An entry
        # that is a link is passed by, with a warning: nothing beneath a link is read.
        found = []
        for entry in self.list_dir(""):
            with suppress(FileNotFoundError):  # removed while we looked
                kind = _kind(self._beneath.lstat(entry).st_mode)
                if kind == "link":
                    log.warning(
                        "%s is a symbolic link: passed by", shown(self._beneath.path(entry))
                    )
                elif kind == "directory" and self.exists(f"{entry}/{member}"):
                    found.append(entry)
        return [e for e in found if unless is None or not self.exists(f"{e}/{unless}")]


def _present(folder: int, name: str) -> bool:
    with suppress(FileNotFoundError):
        return bool(os.stat(name, dir_fd=folder, follow_symlinks=False))
    return False


def _kind(mode: int) -> Literal["file", "directory", "link", "other"]:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    return "directory" if stat.S_ISDIR(mode) else "other"


#: Bytes written between two writeback requests.
WRITEBACK_STEP_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def _load() -> Callable[[int, int, int, int], int] | None:
    if (func := _libc("sync_file_range")) is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        func.restype = ctypes.c_int
    return func  # type: ignore[no-any-return]


_sync_file_range = _load()


class WritebackFile:
    """A new file's buffered writer (``file``, at offset 0) that starts writeback of every
    ``step`` bytes written."""

    def __init__(self, file: io.BufferedWriter, step: int = WRITEBACK_STEP_BYTES) -> None:
        self._file = file
        self._step = step if _sync_file_range is not None else math.inf  # inf: never
        self._written = 0
        self._started = 0  # writeback was requested for [0, _started)

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        count = self._file.write(data)
        self._written += count
        if self._written - self._started >= self._step:
            self._start_writeback()
        return count

    def tell(self) -> int:
        return self._written

    def _start_writeback(self) -> None:
        assert _sync_file_range is not None
        self._file.flush()  # the buffered tail must be in the page cache to be written back
        length = self._written - self._started
        if _sync_file_range(self._file.fileno(), self._started, length, _SYNC_FILE_RANGE_WRITE):
            # Refused here (a file system without it): the closing fsync does all the work, as
            # it would without this class.
            self._step = math.inf
        self._started = self._written
