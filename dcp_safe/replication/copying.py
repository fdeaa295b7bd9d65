"""Verified copies of checkpoint files from one root to another, checked as the bytes stream.

Shared by the :class:`~dcp_safe.replication.replicator.Replicator` and the per-rank uploads;
where a copy lands and its publish are the callers'.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import write_buffer_bytes
from dcp_safe.backends.listed_sizes import ListedSizes
from dcp_safe.backends.retry import RetryPolicy, call_with_retries
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.errors import CheckpointCorruptError, StorageError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest
from dcp_safe.manifest.signing import MAX_SIGNATURE_BYTES
from dcp_safe.manifest.verify import DEFAULT_CHUNK_BYTES, FileCheck, items_by_file


def copy_buffer_bytes(dest: Backend, chunk_bytes: int) -> int | None:
    """The most host bytes one verified copy to ``dest`` holds at once: the chunk read from the
    source plus ``dest``'s open-file buffers (on S3, ``(max_concurrency + 1)`` part blocks).
    None where ``dest`` buffers by an amount not known here (an fsspec object store not S3).
    """
    buffers = write_buffer_bytes(dest)
    return None if buffers is None else chunk_bytes + buffers


@dataclass(eq=False)
class Copier:
    """Verified copies from ``local`` to ``remote``, file by file."""

    local: Backend
    remote: Backend
    _: KW_ONLY
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    retry: RetryPolicy | None = None
    # Called before each file is written (the lease's check); raising there stops the copy.
    before_each: Callable[[], None] = lambda: None
    # Each remote path, listed before it is written, for the caller's clean-up.
    uploaded: list[str] = field(default_factory=list, init=False)

    def copy_folder(
        self,
        src: str,
        dest: str,
        records: Sequence[FileRecord],
        items: Mapping[str, Sequence[ItemRecord]],
        folders: Iterable[str] = (),
    ) -> None:
        """Copy ``records`` (with their ``items``, by path) from ``src`` to ``dest``, in order,
        after creating the folders they and ``folders`` (relative paths) sit in."""
        self.remote.makedirs(dest)
        for folder in _folders([*(r.path for r in records), *folders]):
            self.remote.makedirs(f"{dest}/{folder}")
        for record in records:
            self.before_each()
            dst = f"{dest}/{record.path}"
            self.uploaded.append(dst)
            copy = functools.partial(
                self._copy_file, f"{src}/{record.path}", dst, record, items.get(record.path, [])
            )
            if self.retry is None:
                copy()
            else:  # started over whole after a transient failure
                call_with_retries("upload", self.remote.full_path(dst), copy, self.retry)

    def _copy_file(
        self, src: str, dst: str, record: FileRecord, items: Sequence[ItemRecord]
    ) -> None:
        """Stream ``src`` to ``dst``, checking the whole-file checksum (small files) or each
        item's (shard files: ``items`` tile the file) from the bytes in flight.

        Raises:
            CheckpointCorruptError: the source is missing, of the wrong size, or fails a checksum
                (``dst`` may then hold a partial copy; it is the caller's to remove).
            StorageError: reading or writing failed.
        """
        path = self.local.full_path(src)
        check = FileCheck(path, record, sorted(items, key=lambda i: i.start))
        try:
            actual = self.local.size(src)
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "file is missing") from None
        if actual != record.size:
            raise CheckpointCorruptError(
                path, "file size differs from the manifest", expected=record.size, actual=actual
            )
        with self.local.open_read(src) as reader, self.remote.open_write(dst) as writer:
            remaining = record.size
            while remaining:
                try:
                    data = reader.read(min(self.chunk_bytes, remaining))
                except StorageError:
                    raise
                except OSError as exc:  # left raw, it would surface as the remote write failing
                    raise StorageError("read", path, exc) from exc
                if not data:
                    raise CheckpointCorruptError(
                        path,
                        "file is shorter than the manifest says",
                        expected=record.size,
                        actual=record.size - remaining,
                    )
                check.update(data)
                writer.write(data)
                remaining -= len(data)
            check.finish()


@dataclass(eq=False)
class CheckpointCopy(Copier):
    """The files of committed checkpoint ``name``, copied and verified on their way to ``remote``.

    Call order: :meth:`copy_files` (any subset, any number of times), then :meth:`finish_upload`
    (the manifest, every object's size, durable folders). :meth:`upload_to` does both for every
    file. :attr:`uploaded` lists what this copy wrote, for the caller's clean-up.
    """

    name: str
    manifest: Manifest
    raw_manifest: bytes
    items: Mapping[str, Sequence[ItemRecord]] = field(init=False)

    def __post_init__(self) -> None:
        where = self.local.full_path(f"{self.name}/{layout.MANIFEST}")
        self.items = items_by_file(where, self.manifest)

    def upload_to(self, dest: str) -> None:
        self.copy_files(dest, self.manifest.files)
        self.finish_upload(dest)

    def copy_files(self, dest: str, records: Iterable[FileRecord]) -> None:
        self.copy_folder(self.name, dest, list(records), self.items)

    def finish_upload(self, dest: str) -> None:
        """Write the manifest (and its signature, if signed), then check that every file of it
        is under ``dest`` whole."""
        self.before_each()
        try:  # a signed checkpoint's signature goes with it, unchecked (that needs the key)
            with self.local.open_read(f"{self.name}/{layout.SIGNATURE}") as stream:
                signature = stream.read(MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            pass  # not signed
        else:
            self.uploaded.append(f"{dest}/{layout.SIGNATURE}")
            self.remote.write_bytes(f"{dest}/{layout.SIGNATURE}", signature)
        self.uploaded.append(f"{dest}/{layout.MANIFEST}")
        self.remote.write_bytes(f"{dest}/{layout.MANIFEST}", self.raw_manifest)
        expected = [(f.path, f.size) for f in self.manifest.files]
        # One listing per folder, not a HEAD per object (thousands at thousands of ranks).
        sizes = ListedSizes(self.remote, "")
        for path, size in [*expected, (layout.MANIFEST, len(self.raw_manifest))]:
            where = self.remote.full_path(f"{dest}/{path}")
            try:
                actual = sizes.size(f"{dest}/{path}")
            except FileNotFoundError as exc:
                raise StorageError("verify", where, "uploaded file is missing") from exc
            if actual != size:
                why = f"uploaded file has {actual} bytes, the manifest says {size}"
                raise StorageError("verify", where, why)
        for folder in _folders(path for path, _ in expected):
            self.remote.sync_dir(f"{dest}/{folder}")


def _folders(paths: Iterable[str]) -> list[str]:
    return sorted({posixpath.dirname(p) for p in paths} - {""})


def open_source(local: Backend, name: str) -> tuple[Manifest, bytes]:
    """The committed local manifest and its exact bytes (the remote copy must be identical);
    CheckpointCorruptError where its marker and manifest disagree, or it changed while opened.
    """
    manifest = open_committed(local, name).manifest
    rel = f"{name}/{layout.MANIFEST}"
    raw = local.read_small(rel, MANIFEST_MAX_BYTES)
    if Manifest.from_json(raw, local.full_path(rel)) != manifest:
        raise CheckpointCorruptError(local.full_path(rel), "manifest changed while being opened")
    return manifest, raw
