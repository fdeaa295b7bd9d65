"""What touched a folder tree: Linux inotify on every folder of it, from any process.

The hostile corpus keeps a sentinel tree outside each root, with links pointing into it from
the root, and must show that no entry point read or wrote anything there. Contents and
modification times show writes; reads leave no trace there (``atime`` is often off), and an
audit hook sees paths opened relative to a folder's descriptor only by their last component.
inotify reports every open, read, write, creation and removal in a watched folder, by any
process (the corpus runs its entry points in subprocesses), so the watch is set on every
folder of the tree before the entry points run, and read after they are done.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

__all__ = ["TreeWatch", "available"]

_IN_ACCESS = 0x001
_IN_MODIFY = 0x002
_IN_ATTRIB = 0x004
_IN_CLOSE_WRITE = 0x008
_IN_OPEN = 0x020
_IN_MOVED_FROM = 0x040
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_ISDIR = 0x40000000
_NAMES = {
    _IN_ACCESS: "read",
    _IN_MODIFY: "written",
    _IN_ATTRIB: "attributes changed",
    _IN_CLOSE_WRITE: "closed after writing",
    _IN_OPEN: "opened",
    _IN_MOVED_FROM: "moved away",
    _IN_MOVED_TO: "moved in",
    _IN_CREATE: "created",
    _IN_DELETE: "removed",
    _IN_DELETE_SELF: "removed",
    _IN_MOVE_SELF: "moved",
    _IN_Q_OVERFLOW: "too many events",
}
_MASK = sum(_NAMES) - _IN_Q_OVERFLOW
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1  # noqa: B018 - present on Linux only
    except (AttributeError, OSError):
        return None
    return libc


def available() -> bool:
    """Whether this platform has inotify."""
    return _libc() is not None


class TreeWatch:
    """inotify watches on every folder under some trees, and what they saw."""

    def __init__(self) -> None:
        libc = _libc()
        if libc is None:
            raise OSError("inotify is not available on this platform")
        self._libc = libc
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._folders: dict[int, Path] = {}

    def add_tree(self, top: Path) -> None:
        """Watch ``top`` and every folder under it (links are not followed)."""
        for folder, _, _ in os.walk(top):
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _MASK)
            if wd < 0:
                raise OSError(ctypes.get_errno(), "inotify_add_watch failed", folder)
            self._folders[wd] = Path(folder)
        self.events()  # what walking the tree just did

    def events(self) -> list[tuple[Path, str]]:
        """What happened since the last call: (path, what), in order."""
        seen: list[tuple[Path, str]] = []
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return seen
            offset = 0
            while offset < len(data):
                wd, mask, _, size = _HEADER.unpack_from(data, offset)
                name = data[offset + _HEADER.size : offset + _HEADER.size + size].rstrip(b"\0")
                offset += _HEADER.size + size
                folder = self._folders.get(wd, Path("?"))
                path = folder / os.fsdecode(name) if name else folder
                for bit, what in _NAMES.items():
                    if mask & bit:
                        seen.append((path, what))

    def close(self) -> None:
        os.close(self._fd)
