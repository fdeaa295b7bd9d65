"""An export's destination: written beside it in a hidden folder, renamed into place whole.

Each file is written through an append-only :class:`~dcp_safe.manifest.streams.HashingSink`
that hashes what it writes (no ``seek``: :mod:`zipfile` writes the torch format sequentially,
sizes and CRCs in a descriptor after each record), so ``SHA256SUMS`` costs no second read.

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

import torch

from dcp_safe import layout
from dcp_safe.adapters.tensor_records import tensor_bytes
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.streams import HashingSink, WritableFile

CHECKSUMS = layout.EXPORT_CHECKSUMS
#: Bytes written (and cast) per call: small next to any tensor worth streaming, large enough
#: that a call's overhead does not show.
SLICE_BYTES = 16 << 20
_EXISTS = "{} exists; pass overwrite=True (dcp-safe export --overwrite) to replace an export"


def write_tensor(sink: WritableFile, tensor: torch.Tensor, out_dtype: torch.dtype) -> None:
    """Write a CPU tensor's bytes as ``out_dtype`` from its own memory, in slices of
    :data:`SLICE_BYTES` (a cast goes through one reused slice-sized buffer)."""
    flat = tensor.reshape(-1).contiguous()  # the reader's fresh tensors already are
    step = max(1, SLICE_BYTES // max(tensor.element_size(), out_dtype.itemsize))
    cast = (
        None if flat.dtype == out_dtype else torch.empty(min(step, flat.numel()), dtype=out_dtype)
    )
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        sink.write(tensor_bytes(piece if cast is None else cast[: piece.numel()].copy_(piece)))


class StagedExport(AbstractContextManager["StagedExport"]):
    """The hidden folder an export is written into, and its publication as ``dest`` (the path
    :func:`check_destination` gave). Leaving the context without :meth:`publish` (or by an
    exception) removes everything written."""

    def __init__(self, dest: str, *, overwrite: bool) -> None:
        self.dest = dest
        self._overwrite = overwrite
        parent, self._leaf = os.path.split(dest)
        os.makedirs(parent, exist_ok=True)
        self._backend = LocalBackend(parent)
        self._work = layout.export_work_dir_name(self._leaf, secrets.token_hex(6))
        os.mkdir(os.path.join(parent, self._work))
        self.digests: dict[str, str] = {}  # the files written so far: their sha256
        self._published = False

    def __exit__(self, *exc_info: object) -> None:
        if not self._published:
            self._backend.remove_tree(self._work)

    def path(self, file_name: str) -> str:
        """Where ``file_name`` is being written (inside the hidden folder)."""
        return os.path.join(self._backend.root, self._work, file_name)

    @contextmanager
    def open(self, file_name: str) -> Iterator[HashingSink]:
        """A new file in the export, hashed as it is written and fsynced when closed."""
        with self._backend.open_write(f"{self._work}/{file_name}") as target:
            sink = HashingSink(target, ChecksumAlgorithm.SHA256)
            yield sink
        self.digests[file_name] = sink.take_checksum().partition(":")[2]

    def publish(self) -> None:
        """Write ``SHA256SUMS``, make the folder durable, and rename it to ``dest``. ConfigError:
        ``dest`` appeared meanwhile (without ``overwrite``); StorageError: a write, fsync or
        rename failed."""
        lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(self.digests.items()))
        with self._backend.open_write(f"{self._work}/{CHECKSUMS}") as target:
            target.write(lines.encode())
        self._backend.sync_dir(self._work)
        replace = self._overwrite and os.path.lexists(self.dest)
        if replace:
            check_destination(self.dest, overwrite=True)
        try:
            old = self._backend.publish_dir(self._work, self._leaf, replace=replace)
        except FileExistsError:
            raise ConfigError(_EXISTS.format(self.dest)) from None
        self._published = True
        if old is not None:
            self._backend.remove_tree(old)
        self._backend.sync_dir("")


def check_destination(dest: str | os.PathLike[str], overwrite: bool) -> str:
    """``dest``'s absolute path, unless it is refused (ConfigError): a URL, there already
    (without ``overwrite``), or not an earlier export (with it; a file system root, which has
    no leaf to create, always exists)."""
    text = os.fspath(dest)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(f"dest must be a local path, got {text!r}")
    path = os.path.abspath(text.removeprefix("file://"))
    if os.path.lexists(path) and not overwrite:
        raise ConfigError(_EXISTS.format(path))
    # Only a folder holding a SHA256SUMS (so no link) is an earlier export.
    ours = not os.path.islink(path) and os.path.isfile(os.path.join(path, CHECKSUMS))
    if os.path.lexists(path) and not ours:
        raise ConfigError(
            f"refusing to replace {path}: it is not an earlier export (no {CHECKSUMS} in it);"
            " remove it yourself or choose another dest"
        )
    return path
