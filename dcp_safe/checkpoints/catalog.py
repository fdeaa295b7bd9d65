"""List and verify committed checkpoints: the read-only view an operator needs.

``list_checkpoints`` reads a marker and a manifest per checkpoint. ``verify_checkpoint`` reads
every byte against its checksum, then decodes what a load would unpickle with the load's own
checks (:func:`~dcp_safe.checkpoints.items.check_loadable`); ``deep=False`` is the quick check:
the marker against the manifest and each file's presence and size, reading no data.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.listed_sizes import ListedSizes
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import (
    CommittedCheckpoint,
    accepted_headers,
    check_signed,
    open_committed,
    recency,
    resolve_name,
)
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, Manifest, RankManifest
from dcp_safe.manifest.signing import resolve_key
from dcp_safe.manifest.verify import check_stream, items_by_file
from dcp_safe.topology import RootLike, as_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as ``list_checkpoints`` reports it."""

    name: str
    path: str
    size_bytes: int
    created_at: float
    world_size: int
    step: int | None
    save_id: str
    #: what the save was given as ``metrics`` (``None``: nothing).
    metrics: Mapping[str, float | str] | None = dataclasses.field(default=None, hash=False)


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` checked."""

    name: str
    path: str
    files_checked: int
    items_checked: int
    bytes_read: int
    seconds: float
    # Object items run through the weights-only check (0 for a quick check or allow_pickle).
    objects_checked: int = 0


def list_checkpoints(
    root: RootLike,
    *,
    storage_options: dict[str, Any] | None = None,
    on_damaged: Callable[[str, CheckpointCorruptError], None] | None = None,
    signing_key: bytes | str | None = None,
) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root``, oldest first (by step, then commit time).

    A name whose marker does not match its manifest, or whose marker or manifest is not a
    well-formed control file (:mod:`dcp_safe.manifest.limits`), is not listed: it is not a
    checkpoint anyone should load (``verify_checkpoint`` names what is wrong with it). Each is
    reported to ``on_damaged`` with its error (default: a logged warning), and never hides the
    others. With a ``signing_key`` (default ``DCP_SAFE_SIGNING_KEY`` if set) only checkpoints
    signed with it are listed."""
    backend = open_backend(root, storage_options)
    found = []
    for header in accepted_headers(backend, resolve_key(signing_key), damaged=on_damaged or _log):
        fields = dataclasses.asdict(header)
        fields["size_bytes"] = fields.pop("total_bytes")
        found.append(CheckpointInfo(path=backend.full_path(header.name), **fields))
    return sorted(found, key=lambda info: recency(info.step, info.created_at, info.name))


def _log(name: str, exc: CheckpointCorruptError) -> None:
    log.warning("not listed: %s is damaged (%s)", name, exc)


def latest_named(root: RootLike, checkpoint_id: str, *, strict: bool = False) -> str:
    """``checkpoint_id``, or for ``"latest"`` the newest sound checkpoint (none:
    CheckpointNotFoundError), saying so when a damaged name present may be newer: a logged
    warning (``inspect``, ``export``), or with ``strict`` a CheckpointCorruptError (``verify``,
    which must check the newest name present).

    ``"latest"`` alone passes a damaged entry by, so that it never hides a good one; a tool
    that did so silently would leave a truncated newest manifest unseen. A damaged entry has no
    step to trust, so it counts as newer unless the number its name ends in
    (``step_000000042``) is below the newest sound one's.
    """
    if checkpoint_id != layout.LATEST:
        return checkpoint_id
    damaged: list[tuple[str, CheckpointCorruptError]] = []
    infos = list_checkpoints(root, on_damaged=lambda n, e: damaged.append((n, e)))
    name = infos[-1].name if infos else ""
    for other, exc in (pair for pair in damaged if not _older(pair[0], than=name)):
        if strict:
            raise CheckpointCorruptError(
                exc.path,
                f"{other}, the newest checkpoint present, is damaged ({exc}); the newest sound"
                f" one is {name or 'none'}: 'dcp-safe verify ROOT NAME' checks one by name",
            )
        if name:
            log.warning("using %s, not %s, which may be newer but is damaged: %s", name, other, exc)
    if not name:
        also = f" ({len(damaged)} damaged: 'dcp-safe ls' names them)" if damaged else ""
        raise CheckpointNotFoundError(as_root(root).url, f"no sound committed checkpoint{also}")
    return name


def _older(name: str, *, than: str) -> bool:
    """Whether both names end in a number and ``name``'s is the smaller."""
    numbers = [n[len(n.rstrip("0123456789")) :] for n in (name, than)]
    return all(numbers) and int(numbers[0]) < int(numbers[1])


def verify_checkpoint(
    root: RootLike,
    name: str = layout.LATEST,
    *,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[FileRecord], None] | None = None,
    deep: bool = True,
    signing_key: bytes | str | None = None,
    allow_pickle: bool = False,
) -> VerifyReport:
    """Check checkpoint ``name`` (or ``"latest"``): every byte, or (``deep=False``) quickly;
    a report of what was checked, when everything matches.

    Args:
        progress: called with each file's record once that file is checked (progress bars).
        deep: read every byte against its checksum (the default). ``False``: the quick check
            (module docstring); its report checks no items.
        signing_key: also require the checkpoint to be signed with this key (default
            ``$DCP_SAFE_SIGNING_KEY``; see :mod:`dcp_safe.manifest.signing`).
        allow_pickle: skip the restricted decoding of ``.metadata`` and object items, as
            ``SafeStorageReader(allow_pickle=True)`` does (a root trusted as code).

    Raises:
        CheckpointNotFoundError: no committed checkpoint by that name.
        CheckpointCorruptError: the first mismatch found, naming the file and item.
        UnsafeCheckpointError: deep, ``.metadata`` or an object item holds a pickle that a load
            refuses (without ``allow_pickle``).
        SignatureError: with a key, the checkpoint is not signed with it
            (``UnsignedCheckpointError``: not signed at all).
        ConfigError: a bad signing key.
    """
    backend = open_backend(root, storage_options)
    opened = open_committed(backend, resolve_name(backend, name))
    return verify_opened(backend, opened, progress, deep, signing_key, allow_pickle)


def verify_opened(
    backend: Backend,
    opened: CommittedCheckpoint,
    progress: Callable[[FileRecord], None] | None = None,
    deep: bool = True,
    signing_key: bytes | str | None = None,
    allow_pickle: bool = False,
) -> VerifyReport:
    """:func:`verify_checkpoint` of a checkpoint already opened on ``backend`` (its marker and
    manifest are not read again)."""
    started = time.perf_counter()
    name, manifest = opened.name, opened.manifest
    key = resolve_key(signing_key)
    if key is not None:
        check_signed(backend, opened, key)
    objects = bytes_read = 0
    if deep:
        _require_complete_listing(backend, name, manifest)
        by_file = items_by_file(backend.full_path(f"{name}/{layout.MANIFEST}"), manifest)
    # The quick check sizes files from one listing per folder, not a request per file; a file
    # a listing lacks is asked for on its own before it is called missing (a snapshot).
    size_of = backend.size if deep else ListedSizes(backend, "").size
    for record in manifest.files:
        rel = f"{name}/{record.path}"
        path = backend.full_path(rel)
        try:
            size = size_of(rel)
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "file is missing") from None
        if size != record.size:
            why = "file size differs from the manifest"
            raise CheckpointCorruptError(path, why, expected=record.size, actual=size)
        if deep:
            with backend.open_read(rel) as stream:
                bytes_read += check_stream(stream, path, record, by_file.get(record.path, []))
        if progress is not None:
            progress(record)
    if deep:
        _verify_rank_manifests(backend, name, manifest)
        if manifest.data_format is None:  # DCP's items; other formats are their files' bytes
            # Here, not at the top: listing (``dcp-safe ls``) must not pay for torch's import.
            from dcp_safe.checkpoints.items import check_loadable

            objects = check_loadable(backend, name, manifest, allow_pickle=allow_pickle)
    return VerifyReport(
        name=name,
        path=backend.full_path(name),
        files_checked=len(manifest.files),
        items_checked=len(manifest.items) if deep else 0,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - started,
        objects_checked=objects,
    )


def _require_complete_listing(backend: Backend, name: str, manifest: Manifest) -> None:
    """The manifest must list every file a load needs: what it omits, nobody checks (the files
    of its items: :func:`~dcp_safe.manifest.verify.items_by_file`, called next)."""
    path = backend.full_path(f"{name}/{layout.MANIFEST}")
    if manifest.world_size > len(manifest.files):  # each rank wrote a rank manifest, at least
        raise CheckpointCorruptError(
            path, f"world size {manifest.world_size} but only {len(manifest.files)} files listed"
        )
    needed = {layout.DCP_METADATA} if manifest.data_format is None else set()
    needed |= {layout.rank_manifest_name(rank) for rank in range(manifest.world_size)}
    if missing := sorted(needed - {record.path for record in manifest.files}):
        raise CheckpointCorruptError(path, f"manifest does not list {', '.join(missing)}")


def _verify_rank_manifests(backend: Backend, name: str, manifest: Manifest) -> None:
    """Each rank manifest (already checksummed as a file) must agree with the global one."""
    for rank in range(manifest.world_size):
        rel = f"{name}/{layout.rank_manifest_name(rank)}"
        path = backend.full_path(rel)
        for item in RankManifest.from_json(backend.read_small(rel, MANIFEST_MAX_BYTES), path).items:
            if manifest.item(item.key) != item:
                why = f"rank manifest disagrees with {layout.MANIFEST}"
                raise CheckpointCorruptError(path, why, item=item.describe())
