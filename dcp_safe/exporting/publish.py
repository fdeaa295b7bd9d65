"""An export's destination: written beside it in a hidden folder, renamed into place whole.

The protocol (fsyncs, ``RENAME_NOREPLACE``, ``RENAME_EXCHANGE`` for ``overwrite``) is in
docs/export.md, "Publication and failures"; the renames and fsyncs are
:class:`~dcp_safe.backends.local_backend.LocalBackend`'s. ``overwrite=True`` replaces only an
earlier export (with a ``SHA256SUMS``): a mistyped ``dest`` must not delete a directory that is
not ours.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from dcp_safe import layout
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.errors import ConfigError
from dcp_safe.exporting.sink import Sha256Sink

__all__ = ["CHECKSUMS", "StagedExport", "check_destination"]

CHECKSUMS = layout.EXPORT_CHECKSUMS


class StagedExport(AbstractContextManager["StagedExport"]):
    """The hidden folder an export is written into, and its publication as ``dest``.

    Use as a context manager: leaving it without :meth:`publish` (or by an exception) removes
    everything written.

    Raises:
        ConfigError: ``dest`` is a URL, exists (without ``overwrite``), or is not an earlier
            export (with it).
    """

    def __init__(self, dest: str | os.PathLike[str], *, overwrite: bool) -> None:
        # A file system root has no leaf to create, but it always exists: refused here.
        self.dest = check_destination(dest, overwrite)
        parent, self._leaf = os.path.split(self.dest)
        self._overwrite = overwrite
        os.makedirs(parent, exist_ok=True)
        self._backend = LocalBackend(parent)
        self._work = layout.export_work_dir_name(self._leaf, secrets.token_hex(6))
        os.mkdir(os.path.join(parent, self._work))
        self._digests: dict[str, str] = {}
        self._published = False

    def __exit__(self, *exc_info: object) -> None:
        if not self._published:
            self._backend.remove_tree(self._work)

    def path(self, file_name: str) -> str:
        """Where ``file_name`` is being written (inside the hidden folder)."""
        return os.path.join(self._backend.root, self._work, file_name)

    @contextmanager
    def open(self, file_name: str) -> Iterator[Sha256Sink]:
        """A new file in the export, hashed as it is written and fsynced when closed."""
        if file_name in self._digests or file_name == CHECKSUMS:
            raise ValueError(f"{file_name} is written twice")  # a caller's bug
        with self._backend.open_write(f"{self._work}/{file_name}") as target:
            sink = Sha256Sink(target)
            yield sink
        self._digests[file_name] = sink.hexdigest()

    @property
    def files(self) -> tuple[str, ...]:
        """The files written so far, sorted."""
        return tuple(sorted(self._digests))

    def publish(self) -> None:
        """Write ``SHA256SUMS``, make the folder durable, and rename it to ``dest``.

        Raises:
            ConfigError: ``dest`` appeared meanwhile (without ``overwrite``).
            StorageError: a write, fsync or rename failed.
        """
        lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(self._digests.items()))
        with self._backend.open_write(f"{self._work}/{CHECKSUMS}") as target:
            target.write(lines.encode())
        self._backend.sync_dir(self._work)
        replace = self._overwrite and os.path.lexists(self.dest)
        if replace:
            _check_dest(self.dest, overwrite=True)
        try:
            old = self._backend.publish_dir(self._work, self._leaf, replace=replace)
        except FileExistsError:
            raise ConfigError(_exists_message(self.dest)) from None
        self._published = True
        if old is not None:
            self._backend.remove_tree(old)
        self._backend.sync_dir("")


def check_destination(dest: str | os.PathLike[str], overwrite: bool) -> str:
    """Refuse ``dest`` now, before any work, as :class:`StagedExport` does; its absolute path.

    Raises:
        ConfigError: see :class:`StagedExport`.
    """
    text = os.fspath(dest)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(f"dest must be a local path, got {text!r}")
    path = os.path.abspath(text.removeprefix("file://"))
    _check_dest(path, overwrite)
    return path


def _exists_message(dest: str) -> str:
    return f"{dest} exists; pass overwrite=True (dcp-safe export --overwrite) to replace an export"


def _check_dest(dest: str, overwrite: bool) -> None:
    if not os.path.lexists(dest):
        return
    if not overwrite:
        raise ConfigError(_exists_message(dest))
    is_export = (
        os.path.isdir(dest)
        and not os.path.islink(dest)
        and os.path.isfile(os.path.join(dest, CHECKSUMS))
    )
    if not is_export:
        raise ConfigError(
            f"refusing to replace {dest}: it is not an earlier export (no {CHECKSUMS} in it);"
            " remove it yourself or choose another dest"
        )
