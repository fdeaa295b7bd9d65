"""The trash: a pruned checkpoint waits there ``Retention(trash_grace_s=...)`` before the
sweeper (:func:`~dcp_safe.retention.sweeper.sweep_trash`) deletes it; meanwhile
:func:`restore_trashed` (``dcp-safe gc --restore NAME``) brings it back.

A checkpoint is committed, in the trash, or gone, and every step below leaves one of the three,
so a prune killed anywhere leaves nothing half-trashed. ``<name>/_TRASHED`` holds the digest
the commit marker held; its age is the trash's clock.

- A root that renames: ``_TRASHED`` is written into ``<name>/`` (still committed there: on such
  a root only the folder's name says what it is), then one rename makes it the hidden folder
  ``.<name>.trash-<id>`` (in the trash; never listed, as no hidden folder is).
- An object store (no rename): ``_TRASHED`` is written (in the trash: listings pass by a name
  holding one, :func:`~dcp_safe.checkpoints.committed.committed_names`), then the commit marker
  is removed. A save never claims a name in the trash (:mod:`dcp_safe.commit.lease`), so its
  files are never mixed with a new save's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.catalog import VerifyReport, verify_opened
from dcp_safe.checkpoints.committed import CommittedCheckpoint, read_marked_manifest
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES
from dcp_safe.manifest.schema import Manifest
from dcp_safe.topology import RootLike


def trash(backend: Backend, name: str) -> None:
    """Move committed checkpoint ``name`` to the trash (CheckpointNotFoundError: it is not
    committed). A storage step's OSError leaves it committed, or in the trash."""
    try:
        marker = backend.read_small(f"{name}/{layout.COMMITTED_MARKER}", CONTROL_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(backend.full_path(name), "not committed") from None
    backend.write_bytes(f"{name}/{layout.TRASH_MARKER}", marker)
    backend.sync_dir(name)
    strategy_for(backend).trash(backend, name)


def trash_entries(backend: Backend) -> list[tuple[str, str]]:
    """``(name, folder)`` of every checkpoint in the trash, sorted: the folder holds it (the
    name itself on an object store)."""
    return strategy_for(backend).trashed(backend)


def restore_trashed(
    root: RootLike,
    name: str,
    *,
    storage_options: dict[str, Any] | None = None,
    signing_key: bytes | str | None = None,
) -> VerifyReport:
    """Commit checkpoint ``name`` again from the trash, once every byte is checked against the
    manifest its trash marker names (the newest copy, if the trash holds several; with
    ``signing_key``, its signature too); the check it passed. A later prune that does not keep
    it trashes it again.

    Raises:
        CheckpointNotFoundError: the trash holds no ``name`` (never trashed, or deleted).
        CheckpointExistsError: a checkpoint named ``name`` is committed (a root that renames).
        CheckpointCorruptError: it does not check; it stays in the trash.
        SignatureError: with a key, it is not signed with it.
    """
    backend = open_backend(root, storage_options)
    layout.validate_name(name)
    entries = [entry for trashed, entry in trash_entries(backend) if trashed == name]
    if not entries:
        raise CheckpointNotFoundError(backend.full_path(name), "not in the trash")
    entry = max(entries, key=lambda e: backend.modified_at(f"{e}/{layout.TRASH_MARKER}") or 0.0)
    path = backend.full_path(f"{entry}/{layout.MANIFEST}")
    raw, digest = read_marked_manifest(backend, entry, layout.TRASH_MARKER, "trashed one", path)
    manifest = Manifest.from_json(raw, path)
    if manifest.name != name:
        raise CheckpointCorruptError(path, "names another checkpoint", actual=manifest.name)
    opened = CommittedCheckpoint(name=entry, manifest=manifest, digest=digest)
    report = verify_opened(backend, opened, signing_key=signing_key)
    _recommit_marker(backend, entry, digest)  # gone where an expiry had begun
    strategy_for(backend).untrash(backend, entry, name)
    return dataclasses.replace(report, name=name, path=backend.full_path(name))


def _recommit_marker(backend: Backend, entry: str, digest: str) -> None:
    """Write the commit marker into ``entry`` again, exclusively; one there already (as a prune
    leaves it, or a restore stopped half-way) must hold the same digest."""
    rel = f"{entry}/{layout.COMMITTED_MARKER}"
    try:
        backend.write_bytes(rel, digest.encode(), exclusive=True)
    except FileExistsError:
        held = backend.read_small(rel, CONTROL_MAX_BYTES).decode("ascii", errors="replace")
        if held.strip() != digest:
            raise CheckpointCorruptError(
                backend.full_path(rel), "holds another digest", expected=digest
            ) from None
    backend.sync_dir(entry)
