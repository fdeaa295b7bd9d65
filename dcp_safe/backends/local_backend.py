"""POSIX backend: plain ``os`` calls, fsync, and ``renameat2`` for atomic directory publish.

fsspec's ``LocalFileSystem`` would work, but its ``mv`` is not a single ``rename(2)`` and it
hides ``fileno()`` behind a wrapper; a checkpoint commit needs exactly rename, fsync of files and
fsync of the parent directory, so this backend calls them directly.

``renameat2(RENAME_NOREPLACE)`` publishes without ever replacing a committed checkpoint, and
``RENAME_EXCHANGE`` replaces one atomically (``overwrite=True``). Where the kernel or file system
lacks them, plain ``rename(2)`` publishes (it refuses a non-empty target, and a committed
checkpoint is never empty), but replacing is refused: two renames would leave a window in which
the name holds no checkpoint at all.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import BinaryIO, Literal

from dcp_safe.backends.backend import Backend, FileStat, WritableFile, not_a_file
from dcp_safe.backends.writeback import WritebackFile
from dcp_safe.errors import CheckpointCorruptError, StorageError

__all__ = ["LocalBackend"]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """True when renameat2 did the job; False when it is unavailable here."""
    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    rc = func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


class LocalBackend(Backend):
    """A directory on a POSIX file system."""

    supports_atomic_rename = True
    supports_exclusive_create = True

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.url = root
        self.root = os.path.abspath(root.removeprefix("file://"))
        self.fsync = fsync

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _fail(self, op: str, rel: str, exc: OSError) -> StorageError:
        return StorageError(op, self._abs(rel), exc)

    @contextmanager
    def open_write(self, rel: str) -> Iterator[WritableFile]:
        path = self._abs(rel)
        try:
            f = open(path, "xb")  # noqa: SIM115 - closed below on every path
        except FileNotFoundError as exc:
            raise self._fail("create", rel, exc) from exc
        except OSError as exc:
            raise self._fail("create", rel, exc) from exc
        try:
            # Durable files start their writeback as they are written, so the fsync below
            # waits for the tail only (dcp_safe.backends.writeback).
            yield WritebackFile(f) if self.fsync else f
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        except BaseException as exc:
            f.close()
            _unlink_quietly(path)
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                raise self._fail("write", rel, exc) from exc
            raise
        f.close()

    @contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        # Non-blocking open: a FIFO under a checkpoint's name must not hang the reader; the
        # fstat then refuses anything but a regular file (a FIFO, a device such as /dev/zero).
        path = self._abs(rel)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise not_a_file(path, _kind(mode))
            os.set_blocking(fd, True)
            f = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with f:
            yield f

    def read_small(self, rel: str, max_bytes: int) -> bytes:
        # One open, one fstat, one read: the open is non-blocking (a FIFO never waits) and the
        # checks look at what was opened, so nothing can be swapped in between. The buffer is
        # the file's size, not max_bytes: a buffered read(max_bytes + 1) would allocate the
        # whole cap (256 MiB for a manifest) once per file.
        path = self._abs(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except NotADirectoryError as exc:  # a path under a file: absent
            raise FileNotFoundError(errno.ENOENT, "no such file", path) from exc
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise not_a_file(path, _kind(found.st_mode))
            if found.st_size > max_bytes:
                raise CheckpointCorruptError(
                    path, f"{found.st_size} bytes, over the {max_bytes}-byte limit for this file"
                )
            return _read_at_most(fd, found.st_size, max_bytes, path)
        finally:
            os.close(fd)

    def sizes(self, rel: str) -> dict[str, int]:
        found: dict[str, int] = {}
        try:
            with os.scandir(self._abs(rel)) as entries:
                for entry in entries:
                    with suppress(FileNotFoundError):  # removed while we looked
                        # Follows links, as size() does; special files are left out.
                        if entry.is_file():
                            found[entry.name] = entry.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise self._fail("list", rel, exc) from exc
        return found

    def stat(self, rel: str) -> FileStat:
        try:
            found = os.stat(self._abs(rel))
        except NotADirectoryError as exc:  # a path under a file: absent
            raise FileNotFoundError(errno.ENOENT, "no such file", self._abs(rel)) from exc
        kind = _kind(found.st_mode)
        return FileStat(kind, found.st_size if kind == "file" else 0)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        path = self._abs(rel)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            raise
        except OSError as exc:
            raise self._fail("create", rel, exc) from exc
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(path)
            raise self._fail("write", rel, exc) from exc
        os.close(fd)

    def size(self, rel: str) -> int:
        return os.stat(self._abs(rel)).st_size

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._abs(rel))

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self._abs(rel))

    def modified_at(self, rel: str) -> float | None:
        path = self._abs(rel)
        try:
            newest = os.stat(path).st_mtime
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fail("stat", rel, exc) from exc
        for folder, _, files in os.walk(path):
            for name in files:
                try:
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
                except FileNotFoundError:
                    continue  # removed while we looked
        return newest

    def list_dir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._fail("list", rel, exc) from exc

    def makedirs(self, rel: str) -> None:
        try:
            os.makedirs(self._abs(rel), exist_ok=True)
        except OSError as exc:
            raise self._fail("mkdir", rel, exc) from exc

    def remove_tree(self, rel: str) -> None:
        path = self._abs(rel)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._fail("remove", rel, exc) from exc

    def sync_dir(self, rel: str) -> None:
        if not self.fsync:
            return
        try:
            fd = os.open(self._abs(rel), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._fail("fsync", rel, exc) from exc

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        src_path, dst_path = self._abs(src), self._abs(dst)
        try:
            if replace and os.path.exists(dst_path):
                return self._exchange(src, dst)
            if not _renameat2(src_path, dst_path, _RENAME_NOREPLACE):
                if os.path.exists(dst_path):
                    raise FileExistsError(errno.EEXIST, "exists", dst_path)
                os.rename(src_path, dst_path)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "exists", dst_path) from exc
            raise self._fail("rename", src, exc) from exc
        return None

    def _exchange(self, src: str, dst: str) -> str:
        if _renameat2(self._abs(src), self._abs(dst), _RENAME_EXCHANGE):
            return src  # the old checkpoint now lives where the partial was
        # Two plain renames would leave the name empty if we died between them; refuse instead.
        raise StorageError(
            "replace",
            self._abs(dst),
            "this file system cannot swap directories atomically (renameat2 RENAME_EXCHANGE); "
            "the existing checkpoint is untouched - save under a new name instead",
        )


def _kind(mode: int) -> Literal["file", "directory", "other"]:
    if stat.S_ISREG(mode):
        return "file"
    return "directory" if stat.S_ISDIR(mode) else "other"


def _read_at_most(fd: int, size_hint: int, max_bytes: int, path: str) -> bytes:
    """The rest of ``fd``, refused once it passes ``max_bytes`` (the file may have grown since
    its fstat said ``size_hint``)."""
    chunks: list[bytes] = []
    total = 0
    want = size_hint + 1  # usually one read of the whole file, then one that finds its end
    while chunk := os.read(fd, min(want, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise CheckpointCorruptError(path, f"over the {max_bytes}-byte limit for this file")
        want = max(want, 1 << 16)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # no copy of one chunk


def _unlink_quietly(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)
