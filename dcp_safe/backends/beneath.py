"""Local paths resolved beneath their root, one component at a time, never through a link.

Whoever can write a root can plant links in it, to choose which file outside the root a save
appends to or a load reads (docs/integrity.md, "Hostile storage"). So
:class:`~dcp_safe.backends.local_backend.LocalBackend` resolves every path here: each folder is
opened ``O_DIRECTORY | O_NOFOLLOW`` relative to the one above it, the last component relative to
its folder's descriptor, so what is checked is what was opened. The root itself is resolved as
the user gave it (it may well be a link to a scratch disk).

The alternatives: a containment check (``realpath``, then "is it under the root?") races with
a writer who swaps a folder for a link between the check and the open; ``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` does this walk in the kernel, but needs Linux 5.6 and
is not in Python's ``os``; ``O_NOFOLLOW`` on the last component alone leaves every folder above
it open to a link. The walk costs an ``openat`` per folder of the path, small beside the I/O.
Tree walks hold one descriptor per level and refuse a tree deeper than
:data:`~dcp_safe.backends.backend.MAX_WALK_DEPTH` as damaged, so they never recurse deeper.

Errors: a path under a file is absent (``FileNotFoundError``); a link on the way is a
:class:`~dcp_safe.errors.CheckpointCorruptError`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from dcp_safe.backends.backend import MAX_WALK_DEPTH, not_a_file, too_deep
from dcp_safe.errors import CheckpointCorruptError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Beneath:
    """Paths relative to one local (absolute) root, resolved without following links below it.

    Nothing is held open between calls, so the owner (a backend) stays picklable.
    """

    def __init__(self, root: str) -> None:
        self.root = root

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _parts(self, rel: str) -> list[str]:
        parts = rel.rstrip("/").split("/") if rel.rstrip("/") else []
        if any(part in ("", ".", "..") for part in parts):
            raise CheckpointCorruptError(self.path(rel), "not a path beneath the root")
        return parts

    @contextmanager
    def folder(self, rel: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the folder ``rel`` (``""``: the root), closed on exit; with
        ``create``, missing folders are made (never the root), as ``mkdir -p``.
        NotADirectoryError: something on the way is not a folder."""
        parts = self._parts(rel)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for depth, part in enumerate(parts, 1):
                child = self._open_folder(fd, part, "/".join(parts[:depth]), create)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def parent(self, rel: str) -> Iterator[tuple[int, str]]:
        """``rel``'s folder (a descriptor, closed on exit, as :meth:`folder`) and its name."""
        parts = self._parts(rel)
        if not parts:
            raise CheckpointCorruptError(self.root, "the root has no name beneath itself")
        with self.folder("/".join(parts[:-1])) as fd:
            yield fd, parts[-1]

    def _open_folder(self, parent: int, name: str, rel: str, create: bool) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            linked = isinstance(exc, NotADirectoryError) or exc.errno == errno.ELOOP
            if linked and _is_link(parent, name):
                raise CheckpointCorruptError(
                    self.path(rel),
                    "a symbolic link: dcp_safe reads and writes nothing outside its root and"
                    " follows no link beneath it; remove the link (or copy what it points to"
                    " into the root)",
                ) from None
            raise
        with suppress(FileExistsError):  # made meanwhile by another writer: as good
            os.mkdir(name, 0o777, dir_fd=parent)
        return self._open_folder(parent, name, rel, create=False)

    def open(self, rel: str, flags: int) -> int:
        # ``os.open`` of ``rel`` beneath the root with ``O_NOFOLLOW``.
        try:
            with self.parent(rel) as (fd, name):
                return self.open_in(fd, name, rel, flags)
        except NotADirectoryError as exc:  # a path under a file: absent
            raise FileNotFoundError(errno.ENOENT, "no such file", self.path(rel)) from exc

    def open_in(self, folder: int, name: str, rel: str, flags: int, mode: int = 0o644) -> int:
        # ``os.open`` of ``name`` in the open ``folder`` with ``O_NOFOLLOW``.
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP or (
                isinstance(exc, NotADirectoryError) and _is_link(folder, name)
            ):
                raise not_a_file(self.path(rel), "link") from None
            raise

    def lstat(self, rel: str) -> os.stat_result:
        # What is at ``rel`` itself (a link is reported as one, never followed).
        if not self._parts(rel):
            return os.stat(self.root)
        try:
            with self.parent(rel) as (fd, name):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except NotADirectoryError as exc:
            raise FileNotFoundError(errno.ENOENT, "no such file", self.path(rel)) from exc

    def walk(self, rel: str, *, remove: bool = False) -> Iterator[tuple[int, str, str]]:
        """Every entry under the folder ``rel`` that is no folder (links included, never
        followed): ``(its folder's descriptor, its path relative to rel, its name)``, folder by
        folder. NotADirectoryError: ``rel`` is not a folder.

        With ``remove``, each entry is unlinked once yielded and each folder below ``rel`` once
        empty; a link or a file swapped in for a folder meanwhile goes, unfollowed. A tree too
        deep raises with what was above that depth removed.
        """
        with self.folder(rel) as top:
            yield from self._walk(top, rel, "", remove)

    def _walk(self, fd: int, rel: str, where: str, remove: bool) -> Iterator[tuple[int, str, str]]:
        # The folder ``where`` under ``rel`` (open as ``fd``), then each folder in it, depth
        # first: the recursion is as deep as the tree, which is refused past MAX_WALK_DEPTH.
        folders, others = _listing(fd)
        for name in others:
            yield fd, f"{where}{name}", name
            if remove:
                with suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        for name in folders:
            below = f"{rel}/{where}{name}".strip("/")
            if where.count("/") >= MAX_WALK_DEPTH:
                raise too_deep(self.path(below))
            try:
                child = self._open_folder(fd, name, below, create=False)
            except FileNotFoundError:  # removed while we looked
                continue
            except (NotADirectoryError, CheckpointCorruptError):
                if not remove:
                    raise
                with suppress(FileNotFoundError):  # swapped meanwhile
                    os.unlink(name, dir_fd=fd)
                continue
            try:
                yield from self._walk(child, rel, f"{where}{name}/", remove)
            finally:
                os.close(child)
            if remove:
                with suppress(FileNotFoundError):
                    os.rmdir(name, dir_fd=fd)

    def remove(self, rel: str) -> None:
        # ``rel`` and, for a folder, everything under it; nothing when absent. A link is
        # removed, never followed.
        try:
            with self.parent(rel) as (parent, name):
                if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    for _ in self.walk(rel, remove=True):
                        pass
                    os.rmdir(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
        except (FileNotFoundError, NotADirectoryError):
            return


def _is_link(folder: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _listing(fd: int) -> tuple[list[str], list[str]]:
    # The folders and the other entries (links included) of the open folder ``fd``.
    folders: list[str] = []
    others: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            with suppress(FileNotFoundError):  # removed while we looked
                (folders if entry.is_dir(follow_symlinks=False) else others).append(entry.name)
    return sorted(folders), sorted(others)
