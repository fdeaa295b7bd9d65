"""Trees of folders nested thousands deep, as a writer of a root can plant them, and their removal.

Such a tree cannot be named by one path string (the path is longer than ``PATH_MAX``), and a
recursive walk (``shutil.rmtree``, ``os.walk``, pytest's own clean-up of its temporary folders)
fails on it with ``RecursionError``. So both are done here with descriptors, one level at a time,
holding one descriptor at once: a test that plants one removes it before it ends.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["make_deep_tree", "remove_deep_tree"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def make_deep_tree(top: Path, depth: int, *, mtime: float | None = None) -> None:
    """``top/d/d/.../d/f``: ``depth`` folders below the new folder ``top``, a file at the bottom.

    Args:
        mtime: give every folder and the file this modification time (an old leftover).
    """
    top.mkdir()
    fd = os.open(top, _DIR)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", _DIR, dir_fd=fd)
            os.close(fd)
            fd = below
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        if mtime is not None:
            os.utime("f", (mtime, mtime), dir_fd=fd)
            while True:  # back up, dating each folder
                os.utime(fd, (mtime, mtime))
                if os.path.samestat(os.fstat(fd), os.stat(top)):
                    break
                above = os.open("..", _DIR, dir_fd=fd)
                os.close(fd)
                fd = above
    finally:
        os.close(fd)


def remove_deep_tree(top: Path) -> None:
    """Remove ``top`` and everything under it, however deep (links are removed, unfollowed)."""
    if not top.exists():
        return
    fd, depth = os.open(top, _DIR), 0
    try:
        while True:
            entries = _entries(fd)
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=fd)
            folder = next((e.name for e in entries if e.is_dir(follow_symlinks=False)), None)
            if folder is not None:
                below = os.open(folder, _DIR, dir_fd=fd)
                os.close(fd)
                fd, depth = below, depth + 1
                continue
            if depth == 0:
                break
            inode = os.fstat(fd).st_ino
            above = os.open("..", _DIR, dir_fd=fd)
            os.close(fd)
            fd, depth = above, depth - 1
            name = next(e.name for e in _entries(fd) if e.inode() == inode)
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(top)


def _entries(fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(fd) as found:
        return list(found)
