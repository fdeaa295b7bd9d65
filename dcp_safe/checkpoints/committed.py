"""Find and open committed checkpoints under a root: the marker checked against the manifest
(docs/architecture.md, "The rule"), so whatever opens has a manifest fit for further checks.

For readers that hold a signing key, :func:`check_signed` checks the HMAC in ``_SIGNATURE``
against the digest of the very bytes the opened manifest was parsed from (nothing swapped in
after the open counts, nothing parsed twice) and requires every checksum in it to be
cryptographic; item checks then authenticate every byte a load uses. Threat model:
docs/integrity.md, "Signed checkpoints".
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidCheckpointNameError,
    SignatureError,
    UnsignedCheckpointError,
)
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.manifest.signing import MAX_SIGNATURE_BYTES, check_signature, is_cryptographic
from dcp_safe.untrusted import shown

log = logging.getLogger(__name__)

_V = TypeVar("_V")


class _Kept(Generic[_V]):
    """The last ``count`` values put, by the digest of the manifest bytes they came from; safe
    across threads. A lowered ``count`` holds from the next put on."""

    def __init__(self, count: int) -> None:
        self.count, self._values, self._lock = count, OrderedDict[str, _V](), threading.Lock()

    def get(self, digest: str) -> _V | None:
        with self._lock:
            value = self._values.get(digest)
            if value is not None:
                self._values.move_to_end(digest)
            return value

    def put(self, digest: str, value: _V) -> _V:
        with self._lock:
            self._values[digest] = value
            self._values.move_to_end(digest)
            while len(self._values) > self.count:
                self._values.popitem(last=False)
        return value


# Parsed manifests: the same bytes parse to the same Manifest, so a manifest read again (each
# prune lists every checkpoint; a commit's check opens it once more) is hashed and compared with
# its marker as always, but parsed once. At 10,000 items a parse costs ~0.2 s of Python on the
# manager's thread and the result ~24 MiB: the last few are kept.
_parsed: _Kept[Manifest] = _Kept(4)
# What listings need of a checkpoint opened before: a few hundred bytes each, so far more are
# kept. Filled only once every check of ``open_committed`` passed (here, or in the checkpoint
# worker that verified a new checkpoint: ``remember_header``).
_headers: _Kept[CommittedHeader] = _Kept(1024)


def keep_parsed(count: int) -> None:
    """Keep at most ``count`` parsed manifests in this process (default 4)."""
    _parsed.count = count


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint whose marker and manifest agree."""

    name: str
    manifest: Manifest
    #: ``manifest_digest`` of the exact bytes ``manifest`` was parsed from (what the marker
    #: holds, and what a signature covers).
    digest: str


@dataclass(frozen=True)
class CommittedHeader:
    """What listings and ``latest`` need of a committed checkpoint (its manifest's header)."""

    name: str
    step: int | None
    created_at: float
    world_size: int
    total_bytes: int
    save_id: str
    #: the metrics the save was given (``Manifest.metrics``), for listings and retention.
    metrics: Mapping[str, float | str] | None = field(default=None, hash=False)

    @classmethod
    def of(cls, manifest: Manifest) -> CommittedHeader:
        return cls(**{field.name: getattr(manifest, field.name) for field in fields(cls)})


def remember_header(digest: str, header: CommittedHeader) -> None:
    """Keep ``header`` for the manifest whose bytes have ``digest``, which passed every check
    of :func:`open_committed` (in this process or in one that reports to it)."""
    _headers.put(digest, header)


def committed_names(backend: Backend, marker: str = layout.COMMITTED_MARKER) -> list[str]:
    """Names under the root that carry ``marker`` (a commit marker; not yet checked further).

    Found from listings alone where storage allows it. A name that breaks the name rule
    (:func:`~dcp_safe.layout.validate_name`) is no checkpoint, whatever it holds: it is passed
    by with a warning that shows it escaped.
    """
    names = []
    # Not one in the trash where a prune stopped before removing the commit marker (an object
    # store): asked of the same listing, as a second walk would double every listing's cost.
    for entry in backend.entries_holding(marker, unless=strategy_for(backend).hidden_by):
        # A partial about to be renamed into place, or a checkpoint in the trash (POSIX).
        if entry.startswith("."):
            continue
        try:
            names.append(layout.validate_name(entry))
        except InvalidCheckpointNameError:
            log.warning("passed by: %s is not a checkpoint name", shown(backend.full_path(entry)))
    return names


def open_committed(backend: Backend, name: str) -> CommittedCheckpoint:
    """Open ``name``, checking its marker against its manifest: CheckpointNotFoundError without
    a marker (never committed, or not there at all); CheckpointCorruptError if the manifest is
    missing, malformed or not the one the marker names, a control file is not a regular file or
    over its cap, or an item lies in a file the manifest does not list."""
    return _opened(name, *_read_committed(backend, name))


def open_header(backend: Backend, name: str) -> tuple[CommittedHeader, str]:
    """``name``'s header and manifest digest, as :func:`open_committed` would give them (and
    raise). The marker and the manifest bytes are read and checked against each other every
    time; only the parse is skipped when these exact bytes passed every check before (a
    manager's retention lists every checkpoint after each save, and at 10,000 items a parse
    costs ~0.3 s of Python on whichever thread asks)."""
    raw, actual, manifest_path = _read_committed(backend, name)
    header = _headers.get(actual)
    if header is None or header.name != name:
        header = CommittedHeader.of(_opened(name, raw, actual, manifest_path).manifest)
    return header, actual


def _read_committed(backend: Backend, name: str) -> tuple[bytes, str, str]:
    """``name``'s manifest bytes, their digest (checked against the marker) and its path."""
    path = backend.full_path(f"{name}/{layout.MANIFEST}")
    got = read_marked_manifest(backend, name, layout.COMMITTED_MARKER, "committed checkpoint", path)
    return (*got, path)


def _opened(name: str, raw: bytes, actual: str, manifest_path: str) -> CommittedCheckpoint:
    manifest = _parsed.get(actual) or _parsed.put(actual, Manifest.from_json(raw, manifest_path))
    if manifest.name != name:
        raise CheckpointCorruptError(
            manifest_path, "manifest names another checkpoint", expected=name, actual=manifest.name
        )
    # Data is read only from the files the manifest lists (and sizes and checks).
    unlisted = {item.file for item in manifest.items} - {record.path for record in manifest.files}
    if unlisted:
        why = f"items in files the manifest does not list: {', '.join(sorted(unlisted)[:5])}"
        raise CheckpointCorruptError(manifest_path, why)
    remember_header(actual, CommittedHeader.of(manifest))
    return CommittedCheckpoint(name=name, manifest=manifest, digest=actual)


def read_marked_manifest(
    backend: Backend, name: str, marker: str, what: str, where: str
) -> tuple[bytes, str]:
    """``name``'s manifest bytes and their digest, which its ``marker`` file must hold:
    CheckpointNotFoundError without the marker (no ``what`` under ``name``);
    CheckpointCorruptError naming ``where`` without a manifest, or another than the marker names.
    """
    try:
        raw_marker = backend.read_small(f"{name}/{marker}", CONTROL_MAX_BYTES)
    except FileNotFoundError:
        # A missing bucket or root folder reads as a missing marker too: say which it is.
        why = "" if backend.exists("") else f"; the root {backend.full_path('')} does not exist"
        raise CheckpointNotFoundError(
            backend.full_path(name), f"no {what} (no {marker} marker){why}"
        ) from None
    expected = raw_marker.decode("ascii", errors="replace").strip()
    try:
        raw = backend.read_small(f"{name}/{layout.MANIFEST}", MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointCorruptError(where, f"{what} has no manifest") from None
    actual = manifest_digest(raw)
    if actual != expected:
        why = f"manifest does not match the digest in {marker}"
        raise CheckpointCorruptError(where, why, expected=expected[:100], actual=actual)
    return raw, actual


def publish_marked(
    local: Backend, work: str, final: str, raw_manifest: bytes, marker: str, what: str
) -> None:
    """Make ``work`` (its other files landed) the folder ``final``: the manifest goes in, then
    ``marker`` with its digest, last, then the rename, so a folder under its name is whole
    (CheckpointExistsError if ``final`` exists: ``what`` holds it)."""
    local.write_bytes(f"{work}/{layout.MANIFEST}", raw_manifest)
    local.write_bytes(f"{work}/{marker}", manifest_digest(raw_manifest).encode())
    local.sync_dir(work)
    try:
        local.publish_dir(work, final, replace=False)
    except FileExistsError as exc:
        raise CheckpointExistsError(local.full_path(final), f"{what} holds it") from exc
    local.sync_dir(final.rpartition("/")[0])


def recency(step: int | None, created_at: float, name: str) -> tuple[int, float, str]:
    """The order of "newest": by training step, then commit time, then name.

    Step first: commit times come from each writer's clock, and a fast clock must not pin an
    old checkpoint as the newest. A checkpoint without a step is older than any with one.
    """
    return (-1 if step is None else step, created_at, name)


def resolve_name(backend: Backend, checkpoint_id: str, *, signing_key: bytes | None = None) -> str:
    """``checkpoint_id`` itself, or for ``"latest"`` the newest committed checkpoint
    (:func:`recency`). One whose manifest does not open, or (with a ``signing_key``) that is not
    signed with it, is skipped, so a damaged or planted newest checkpoint never hides a good one.
    CheckpointNotFoundError: nothing is committed; if the key signed no committed checkpoint,
    the refusal of the last one looked at (a ``SignatureError``)."""
    if checkpoint_id != layout.LATEST:
        return layout.validate_name(checkpoint_id)
    refused: list[CheckpointCorruptError] = []
    headers = accepted_headers(backend, signing_key, refused=lambda _, exc: refused.append(exc))
    newest = max((recency(h.step, h.created_at, h.name) for h in headers), default=None)
    if newest is None:
        if refused:
            raise refused[-1]
        raise CheckpointNotFoundError(backend.url, "no committed checkpoint under this root")
    return newest[2]


def accepted_headers(
    backend: Backend,
    signing_key: bytes | None = None,
    *,
    damaged: Callable[[str, CheckpointCorruptError], None] = lambda name, exc: None,
    refused: Callable[[str, CheckpointCorruptError], None] | None = None,
) -> Iterator[CommittedHeader]:
    """The header of each committed checkpoint that opens (and is signed with ``signing_key``).

    With a key, only such checkpoints count (``latest``, listings, retention): an unsigned one
    is skipped like a damaged one, so nobody who can write the root can push a signed one out.
    A name whose manifest does not open goes to ``damaged``; one not signed with the key to
    ``refused`` (default: ``damaged``); one removed since the listing is skipped. Without a
    key, only the header is read (:func:`open_header`).
    """
    for name in committed_names(backend):
        try:
            if signing_key is None:
                header = open_header(backend, name)[0]
            else:
                opened = open_committed(backend, name)
                header = CommittedHeader.of(opened.manifest)
                try:
                    check_signed(backend, opened, signing_key)
                except CheckpointCorruptError as exc:
                    (refused or damaged)(name, exc)
                    continue
        except CheckpointNotFoundError:
            continue  # removed since it was listed
        except CheckpointCorruptError as exc:
            damaged(name, exc)
            continue
        yield header


def check_signed(backend: Backend, opened: CommittedCheckpoint, key: bytes) -> None:
    """Raise unless the manifest of ``opened`` (from :func:`open_committed` on ``backend``) is
    signed with ``key``: UnsignedCheckpointError without a ``_SIGNATURE``; SignatureError for a
    signature from another key, or over another manifest, or over one with a checksum that is
    not cryptographic."""
    name, manifest = opened.name, opened.manifest
    manifest_path = backend.full_path(f"{name}/{layout.MANIFEST}")
    rel = f"{name}/{layout.SIGNATURE}"
    try:
        # Stat first: a FIFO or an endless device under this name is refused, not waited on.
        signature = backend.read_small(rel, MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        raise UnsignedCheckpointError(
            backend.full_path(name), f"the checkpoint has no {layout.SIGNATURE}"
        ) from None
    except CheckpointCorruptError as exc:  # not a regular file, or too large
        raise SignatureError(backend.full_path(rel), f"unusable signature file: {exc}") from None
    check_signature(key, opened.digest, signature, manifest_path)
    sums = [f.checksum for f in manifest.files] + [i.checksum for i in manifest.items]
    weak = [sum_ for sum_ in sums if sum_ is not None and not is_cryptographic(sum_)]
    if weak or not is_cryptographic(manifest.checksum_algorithm + ":"):
        shown = weak[0] if weak else manifest.checksum_algorithm
        raise SignatureError(manifest_path, f"signed over a non-cryptographic checksum ({shown})")
