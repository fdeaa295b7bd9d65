"""The writing lease: one save at a time under a name, on storage that cannot rename.

On an object store a save writes straight under ``<name>/``, so two saves of the same name would
overwrite each other's shards before either wrote its marker. Rank 0 therefore first creates
``<name>/_WRITING`` exclusively (holding its save id); a second save finds it and fails at once
with :class:`~dcp_safe.errors.CheckpointExistsError`, before writing a byte. The publisher checks
that the lease is still its own right before writing the marker (a stale writer whose lease was
collected and retaken can never publish), and removes it after. A lease left by a crash is
collected with the rest of the uncommitted prefix by the sweeper, after its grace period.
"""

from __future__ import annotations

import json
import time

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.errors import CheckpointExistsError, StaleWriterError

__all__ = ["acquire_lease", "check_lease", "lease_acquired_at", "release_lease"]


def _lease_path(name: str) -> str:
    return f"{name}/{layout.WRITING_LEASE}"


def acquire_lease(backend: Backend, name: str, save_id: str) -> None:
    """Take the name for this save.

    Raises:
        CheckpointExistsError: the name is committed, or another save holds (or abandoned) it.
    """
    if backend.exists(f"{name}/{layout.COMMITTED_MARKER}"):
        raise CheckpointExistsError(backend.full_path(name))
    body = json.dumps({"save_id": save_id, "acquired_at": time.time()}).encode()
    try:
        backend.write_bytes(_lease_path(name), body, exclusive=True)
    except FileExistsError:
        holder = _holder(backend, name)
        raise CheckpointExistsError(
            backend.full_path(name),
            f"save {holder} is writing it (or abandoned it: the sweeper collects it after its "
            "grace period)",
        ) from None


def check_lease(backend: Backend, name: str, save_id: str) -> None:
    """Raises StaleWriterError unless this save still holds the lease."""
    holder = _holder(backend, name)
    if holder != save_id:
        raise StaleWriterError(
            f"save {save_id} no longer holds {backend.full_path(name)} (held by {holder})",
            {0: "lease lost"},
        )


def release_lease(backend: Backend, name: str) -> None:
    backend.remove_file(_lease_path(name))


def lease_acquired_at(backend: Backend, name: str) -> float | None:
    """When the lease on ``name`` was taken (None: no lease, or an unreadable one)."""
    value = _field(backend, name, "acquired_at")
    return float(value) if isinstance(value, (int, float)) else None


def _holder(backend: Backend, name: str) -> str | None:
    value = _field(backend, name, "save_id")
    return value if isinstance(value, str) else None


def _field(backend: Backend, name: str, key: str) -> object:
    try:
        raw = backend.read_bytes(_lease_path(name))
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw).get(key)
    except (ValueError, AttributeError):
        return None
