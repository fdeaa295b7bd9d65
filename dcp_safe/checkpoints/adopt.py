"""Adopting a stock DCP checkpoint (a folder torch's ``FileSystemWriter`` wrote, local or any
fsspec URL) under a root as a committed checkpoint, running no code from it (docs/adopt.md).

``.metadata`` is a pickle, read without running it
(:func:`~dcp_safe.checkpoints.metadata.decode_pickled_metadata`: a global it does not admit is
refused unless ``allow_pickle``) into the manifest's plain ``dcp_metadata``, which the strict
decoder of :mod:`dcp_safe.manifest.dcp_metadata` checks against the items DCP's
``storage_data`` names. Then every file must be whole (its items back to back, ending where it
ends), every item is read once and checksummed (while copied), and every item decodes as a load
decodes it (:func:`~dcp_safe.checkpoints.items.check_loadable`).
What cannot be checked is in :data:`UNCHECKED`. Published by the usual commit: a publication's
work folder, or (``copy=False``) the marker protocol on the source folder itself, whose files a
failed adoption never removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.items import ZSTD_DESCRIPTOR, check_loadable
from dcp_safe.checkpoints.metadata import decode_pickled_metadata
from dcp_safe.commit.strategy import MarkerStrategy, Publication, strategy_for
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    DcpSafeError,
    PickledClassesError,
    StorageError,
)
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.dcp_metadata import check_declared_sizes
from dcp_safe.manifest.dcp_metadata import decode_dcp_metadata as decode_plain
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest, RankManifest
from dcp_safe.manifest.streams import HashingSink, short_read
from dcp_safe.manifest.verify import DEFAULT_CHUNK_BYTES
from dcp_safe.topology import Root, RootLike, as_root
from dcp_safe.version import __version__

#: What adoption cannot check, as its report states it.
UNCHECKED = (
    "DCP stores no checksums: a byte changed inside a tensor's data before adoption, its size"
    " unchanged, cannot be told from the value saved, and is adopted (and verifies) as it is",
)
_ALGORITHM = ChecksumAlgorithm.XXH3_128
_MAX_WORLD = 1 << 20
_ByFile = dict[str, list[ItemRecord]]  # a file's items, in order


@dataclass(frozen=True)
class AdoptReport:
    """What :func:`adopt` published and checked, and what it could not check (``unchecked``)."""

    name: str
    path: str
    copied: bool
    world_size: int
    files: int
    items: int
    bytes_read: int
    objects_checked: int
    unchecked: tuple[str, ...] = UNCHECKED


def adopt(
    source: RootLike,
    root: RootLike,
    name: str | None = None,
    *,
    copy: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> AdoptReport:
    """Check the stock DCP checkpoint folder ``source`` and commit it under ``root`` as ``name``
    (default: the folder's name), so that it lists, verifies and loads like any other.

    Args:
        source: the folder ``FileSystemWriter`` (or ``FsspecWriter``) wrote: a path or URL.
        copy: copy its files under ``root``, streamed and checksummed on the way; ``False``:
            adopt it where it is, ``root`` being its parent.
        allow_pickle: adopt one whose metadata or objects need pickled classes (a source
            trusted as code; its loads need ``allow_pickle=True`` too).
        storage_options: fsspec options for both (else give each as a ``Root``).

    Raises:
        CheckpointNotFoundError: ``source`` holds no DCP metadata.
        PickledClassesError: it needs pickled classes (all named), without ``allow_pickle``.
        CheckpointCorruptError: a file is missing, truncated or padded, or an item is not what
            the metadata declares (file, item and byte offsets named).
        CheckpointExistsError: ``name`` is committed under ``root`` already, or ``source`` is
            a committed checkpoint (``dcp-safe replicate`` copies one).
        ConfigError: ``copy=False`` where ``root`` is not the source's parent; a bad name.
        StorageError: reading or writing failed; nothing is published.
    """
    src = as_root(source, storage_options)
    parent, folder = _split(src.url)
    name = layout.validate_name(folder if name is None else name)
    dest = open_backend(root, storage_options)
    here = open_backend(Root(parent, src.storage_options)) if copy else dest
    itself = _split(f"{as_root(root, storage_options).url}/{folder}")[0] == parent
    if copy and itself and name == folder:
        raise ConfigError(f"{src.url} is {name} under that root: adopt it in place (copy=False)")
    if not copy and not (itself and name == folder):
        raise ConfigError(
            f"adopting in place (copy=False) publishes the folder where it is: root must be its"
            f" parent ({parent}) and the name its own ({folder}); or copy it"
        )
    if here.exists(f"{folder}/{layout.COMMITTED_MARKER}"):
        why = "it is a committed checkpoint already ('dcp-safe replicate' copies one)"
        raise CheckpointExistsError(here.full_path(folder), why)
    meta_path = here.full_path(f"{folder}/{layout.DCP_METADATA}")
    try:
        raw = here.read_small(f"{folder}/{layout.DCP_METADATA}", MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        why = f"nor a stock DCP checkpoint to adopt (no {layout.DCP_METADATA} in it)"
        raise CheckpointNotFoundError(here.full_path(folder), why) from None
    plain, items = decode_pickled_metadata(raw, meta_path, allow_pickle=allow_pickle)
    sizes = here.sizes(folder)
    by_file = _check_tiling(items, sizes, lambda f: here.full_path(f"{folder}/{f}"))
    save_id, created_at = layout.new_save_id(), here.modified_at(folder) or time.time()
    pending = _manifests(name, save_id, by_file, raw, plain, created_at)[0]
    check_declared_sizes(decode_plain(plain, pending, meta_path), meta_path)
    strategy = strategy_for(dest) if copy else MarkerStrategy()
    publication = strategy.publication(dest, name, save_id)
    publication.claim()
    work, written = publication.work_dir, list[str]()
    try:
        by_file = _read_items(here, folder, dest if copy else None, work, by_file)
        manifest, control = _manifests(name, save_id, by_file, raw, plain, created_at)
        needed: set[str] = set()  # the classes its object items need, all named
        objects = check_loadable(here, folder, manifest, allow_pickle=allow_pickle, classes=needed)
        if needed:
            raise PickledClassesError(here.full_path(folder), sorted(needed))
        if not copy:
            del control[layout.DCP_METADATA]  # the source's own, as read and recorded above
        dest.makedirs(f"{work}/{layout.RANKS_DIR}")
        written += [f"{work}/{rel}" for rel in [*control, layout.MANIFEST]]
        publication.publish_manifest(manifest, control)
    except BaseException as exc:
        _abandon(publication, dest, written, copy=copy, cause=exc)
        raise
    return AdoptReport(
        name=name,
        path=dest.full_path(name),
        copied=copy,
        world_size=manifest.world_size,
        files=len(manifest.files),
        items=len(manifest.items),
        bytes_read=sum(sizes[f] for f in by_file) + len(raw),
        objects_checked=objects,
    )


def _split(url: str) -> tuple[str, str]:
    """A folder's parent and name (a local path made absolute)."""
    parent, folder = posixpath.split((url if "://" in url else os.path.abspath(url)).rstrip("/"))
    if not folder or parent.endswith(":") or parent.endswith(":/"):
        raise ConfigError(f"adopt a checkpoint folder, not a bucket or a file system: {url}")
    return parent, folder


def _abandon(
    publication: Publication, dest: Backend, written: list[str], *, copy: bool, cause: BaseException
) -> None:
    """After a failed adoption: a copy is discarded as a failed save is; in place, only what
    this adoption wrote beside the source's files goes, then its lease."""
    if copy:
        publication.discard(cause)
        return
    with contextlib.suppress(OSError, DcpSafeError):  # best effort, as a failed save's is
        if not dest.exists(f"{publication.name}/{layout.COMMITTED_MARKER}"):
            for rel in written:
                dest.remove_file(rel)
            dest.remove_empty_dir(f"{publication.name}/{layout.RANKS_DIR}")
            publication.release()


# ---------------------------------------------------------------------------- the files


def _check_tiling(
    items: list[ItemRecord], sizes: dict[str, int], where: Callable[[str], str]
) -> _ByFile:
    """Each file's items in order: back to back, ending where the file ends, as
    ``FileSystemWriter`` writes them; no item named twice."""
    by_file: _ByFile = {}
    if len({item.key for item in items}) != len(items):
        raise CheckpointCorruptError(where(layout.DCP_METADATA), "an item is named twice")
    for item in sorted(items, key=lambda i: (i.start, i.length)):
        by_file.setdefault(item.file, []).append(item)
    for file, group in by_file.items():
        if file not in sizes:
            raise CheckpointCorruptError(where(file), "file is missing", item=group[0].describe())
        spans = [(i.describe(), i.start, i.length) for i in group]
        check_tiling(where(file), spans, 0, sizes[file], "item")
    return by_file


def check_tiling(
    path: str, spans: Iterable[tuple[str, int, int]], begin: int, size: int, what: str
) -> None:
    """Raise :class:`CheckpointCorruptError` unless the ``(label, start, length)`` spans
    (``what``: items, tensors) tile bytes ``begin`` to ``size`` of the file ``path`` back to back,
    as ``FileSystemWriter`` writes a shard's items and the safetensors format a file's tensors."""
    end = begin
    for label, start, length in sorted(spans, key=lambda span: span[1:]):
        at = f"bytes {start}..{start + length}"
        if start != end:
            how = "leave a gap" if start > end else "overlap"
            why = f"{what}s {how} before the one at {at}"
            raise CheckpointCorruptError(path, why, item=label, expected=end, actual=start)
        end += length
        if end > size:
            why = f"the file ends inside this {what} (truncated), at {at}"
            raise CheckpointCorruptError(path, why, item=label, expected=end, actual=size)
    if end != size:
        why = f"the file is longer than its {what}s (bytes after the last {what})"
        raise CheckpointCorruptError(path, why, expected=end, actual=size)


def _read_items(
    here: Backend, folder: str, dest: Backend | None, work: str, by_file: _ByFile
) -> _ByFile:
    """``by_file`` with every item's checksum, from one read of each file (copied to ``dest``
    on the way; in place, the bytes go to ``os.devnull``)."""
    summed: _ByFile = {}
    if dest is not None:
        dest.makedirs(work)
    for file, items in by_file.items():
        path = here.full_path(f"{folder}/{file}")
        with (
            here.open_read(f"{folder}/{file}") as reader,
            open(os.devnull, "wb") if dest is None else dest.open_write(f"{work}/{file}") as target,
        ):
            sink = HashingSink(target, _ALGORITHM)
            for item in items:
                sink.expect(left := item.length)
                while left:
                    try:
                        data = reader.read(min(DEFAULT_CHUNK_BYTES, left))
                    except DcpSafeError:
                        raise
                    except OSError as exc:
                        raise StorageError("read", path, exc) from exc
                    if not data:
                        raise short_read(path, item.describe(), item.length, item.length - left)
                    left -= sink.write(data)
                summed.setdefault(file, []).append(
                    dataclasses.replace(item, checksum=sink.take_checksum())
                )
    return summed


def _manifests(
    name: str, save_id: str, by_file: _ByFile, raw: bytes, plain: dict[str, Any], created_at: float
) -> tuple[Manifest, dict[str, bytes]]:
    """The global manifest and the control files (``.metadata``, the rank manifests). A file
    is rank R's when DCP named it ``__R_<n>.distcp``; any other, rank 0's."""
    shards: dict[int, list[FileRecord]] = {}
    for file, group in sorted(by_file.items()):
        record = FileRecord(path=file, size=sum(i.length for i in group))
        shards.setdefault(layout.rank_of_shard(file) or 0, []).append(record)
    world_size = max(shards, default=0) + 1
    if world_size > _MAX_WORLD:
        raise CheckpointCorruptError(name, f"a shard file names rank {world_size - 1}")
    control, files, items = {layout.DCP_METADATA: raw}, list[FileRecord](), list[ItemRecord]()
    for rank in range(world_size):
        own = shards.get(rank, [])
        mine = [i for f in own for i in by_file[f.path]]
        control[layout.rank_manifest_name(rank)] = RankManifest(
            name=name,
            save_id=save_id,
            rank=rank,
            checksum_algorithm=_ALGORITHM.value,
            files=tuple(own),
            items=tuple(mine),
        ).to_json()
        files, items = files + own, items + mine
    files += [
        FileRecord(path=rel, size=len(data), checksum=digest_bytes(data, _ALGORITHM))
        for rel, data in control.items()
    ]
    manifest = Manifest(
        name=name,
        save_id=save_id,
        world_size=world_size,
        created_at=created_at,
        checksum_algorithm=_ALGORITHM.value,
        compression="zstd" if any(ZSTD_DESCRIPTOR in i.transforms for i in items) else "none",
        files=tuple(files),
        items=tuple(items),
        dcp_safe_version=__version__,
        torch_version=torch.__version__,
        dcp_metadata=plain,
    )
    return manifest, control
