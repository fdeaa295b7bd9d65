"""Verified copies of checkpoint files from one root to another, checked as the bytes stream.

Shared by the :class:`~dcp_safe.replication.replicator.Replicator` and the per-rank uploads;
where a copy lands and its publish are the callers'.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence

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

__all__ = [
    "open_source",
    "DEFAULT_CHUNK_BYTES",
    "CheckpointCopy",
    "copy_buffer_bytes",
    "copy_file_verified",
    "copy_files",
]


def copy_file_verified(
    source: Backend,
    src: str,
    dest: Backend,
    dst: str,
    record: FileRecord,
    items: Sequence[ItemRecord],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    retry: RetryPolicy | None = None,
) -> None:
    """Stream ``source``'s ``src`` to ``dest``'s ``dst``, checking the whole-file checksum (small
    files) or each item's (shard files: ``items`` tile the file) from the bytes in flight.

    Args:
        retry: how the copy is started over whole after a transient failure (None: once).

    Raises:
        CheckpointCorruptError: the source is missing, of the wrong size, or fails a checksum
            (``dst`` may then hold a partial copy; it is the caller's to remove).
        StorageError: reading or writing failed.
    """
    if retry is not None:
        copy = functools.partial(
            copy_file_verified, source, src, dest, dst, record, items, chunk_bytes=chunk_bytes
        )
        call_with_retries("upload", dest.full_path(dst), copy, retry)
        return
    path = source.full_path(src)
    check = FileCheck(path, record, sorted(items, key=lambda i: i.start))
    try:
        actual = source.size(src)
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "file is missing") from None
    if actual != record.size:
        raise CheckpointCorruptError(
            path, "file size differs from the manifest", expected=record.size, actual=actual
        )
    with source.open_read(src) as reader, dest.open_write(dst) as writer:
        remaining = record.size
        while remaining:
            data = _read(reader.read, min(chunk_bytes, remaining), path)
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


def copy_buffer_bytes(dest: Backend, chunk_bytes: int) -> int | None:
    """The most host bytes one verified copy to ``dest`` holds at once: the chunk read from the
    source plus ``dest``'s open-file buffers (on S3, ``(max_concurrency + 1)`` part blocks).
    None where ``dest`` buffers by an amount not known here (an fsspec object store not S3).
    """
    buffers = write_buffer_bytes(dest)
    return None if buffers is None else chunk_bytes + buffers


class CheckpointCopy:
    """The files of one committed checkpoint, copied and verified on their way to ``remote``.

    Call order: :meth:`copy_files` (any subset, any number of times), then :meth:`finish_upload`
    (the manifest, every object's size, durable folders). :meth:`upload_to` does both for every
    file. :attr:`uploaded` lists what this copy wrote, for the caller's clean-up.

    Args:
        before_each: called before each file is written (the lease's check); raising there
            stops the copy.
    """

    def __init__(
        self,
        local: Backend,
        remote: Backend,
        name: str,
        manifest: Manifest,
        raw_manifest: bytes,
        chunk_bytes: int,
        *,
        retry: RetryPolicy | None = None,
        before_each: Callable[[], None] = lambda: None,
    ) -> None:
        self.local, self.remote, self.name = local, remote, name
        self.before_each = before_each
        self.manifest = manifest
        self.raw_manifest = raw_manifest
        self.chunk_bytes = chunk_bytes
        self.retry = retry
        self.uploaded: list[str] = []
        self.items = items_by_file(local.full_path(f"{name}/{layout.MANIFEST}"), manifest)
        self.records = {f.path: f for f in manifest.files}

    def upload_to(self, dest: str) -> None:
        """Copy every file and the manifest under ``dest``, then check every remote size."""
        self.copy_files(dest, self.manifest.files)
        self.finish_upload(dest)

    def copy_files(self, dest: str, records: Iterable[FileRecord]) -> None:
        """Copy ``records`` (files of this checkpoint) under ``dest``, verified, in order."""
        copy_files(
            self.local,
            self.name,
            self.remote,
            dest,
            list(records),
            self.items,
            chunk_bytes=self.chunk_bytes,
            retry=self.retry,
            uploaded=self.uploaded,
            before_each=self.before_each,
        )

    def finish_upload(self, dest: str) -> None:
        """Write the manifest (and its signature, if signed), then check that every file of it
        is under ``dest`` whole."""
        self.before_each()
        self._copy_signature(dest)
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

    def _copy_signature(self, dest: str) -> None:
        """A signed checkpoint's ``_SIGNATURE`` goes with it, unchecked (that needs the key)."""
        try:
            with self.local.open_read(f"{self.name}/{layout.SIGNATURE}") as stream:
                signature = stream.read(MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            return
        self.uploaded.append(f"{dest}/{layout.SIGNATURE}")
        self.remote.write_bytes(f"{dest}/{layout.SIGNATURE}", signature)


def copy_files(
    source: Backend,
    src_dir: str,
    dest: Backend,
    dst_dir: str,
    records: Sequence[FileRecord],
    items: Mapping[str, Sequence[ItemRecord]],
    *,
    chunk_bytes: int,
    retry: RetryPolicy | None,
    uploaded: list[str],
    before_each: Callable[[], None],
    folders: Iterable[str] = (),
) -> None:
    """Copy ``records`` from ``src_dir`` to ``dst_dir``, verified, in order, after creating
    the folders they (and ``folders``, relative paths) sit in.

    Args:
        items: each file's items, by path (its checksums: :func:`copy_file_verified`).
        uploaded: each remote path is appended before it is written, for the caller's clean-up.
        before_each: called before each file is written (the lease's check); raising there
            stops the copy.
    """
    dest.makedirs(dst_dir)
    for folder in _folders([*(r.path for r in records), *folders]):
        dest.makedirs(f"{dst_dir}/{folder}")
    for record in records:
        before_each()
        dst = f"{dst_dir}/{record.path}"
        uploaded.append(dst)
        copy_file_verified(
            source,
            f"{src_dir}/{record.path}",
            dest,
            dst,
            record,
            items.get(record.path, []),
            chunk_bytes=chunk_bytes,
            retry=retry,
        )


def _folders(paths: Iterable[str]) -> list[str]:
    return sorted({posixpath.dirname(p) for p in paths} - {""})


def _read(read: Callable[[int], bytes], size: int, path: str) -> bytes:
    # Map here: left raw, a local read error would surface as the remote write failing.
    try:
        return read(size)
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError("read", path, exc) from exc


def open_source(local: Backend, name: str) -> tuple[Manifest, bytes]:
    """The committed local manifest and its exact bytes (the remote copy must be identical).

    Raises:
        CheckpointNotFoundError: ``name`` is not committed locally.
        CheckpointCorruptError: its marker and manifest disagree, or it changed while opened.
    """
    manifest = open_committed(local, name).manifest
    rel = f"{name}/{layout.MANIFEST}"
    raw = local.read_small(rel, MANIFEST_MAX_BYTES)
    if Manifest.from_json(raw, local.full_path(rel)) != manifest:
        raise CheckpointCorruptError(local.full_path(rel), "manifest changed while being opened")
    return manifest, raw
