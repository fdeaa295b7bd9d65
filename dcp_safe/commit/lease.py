"""The writing lease: one save at a time under a name, on storage that cannot rename.

On an object store a save writes straight under ``<name>/``, so two saves of the same name would
overwrite each other's shards — and the loser its manifest after the winner's marker — unless
only one of them ever writes there. Rank 0 therefore takes the name before writing a byte, in
one of two ways, chosen by the backend's ``supports_exclusive_create``:

* **One lease, created exclusively** (S3 that honours ``If-None-Match``, ``memory://``):
  ``<name>/_WRITING``, holding the save id; a second save's create is refused.
* **One lease per save** (storage without a real exclusive create: an S3-compatible server that
  ignores ``If-None-Match``, other fsspec file systems): the save writes
  ``<name>/_WRITING-<save id>``, a key nobody else writes, then lists ``<name>/``. A save that
  sees no other lease holds the name; one that sees another withdraws its own. Of two saves,
  the one that lists second sees the other's lease (written before the first listing, which
  came before the second), so at most one holds the name. Both may see each other and withdraw;
  each tries again after a random pause, and gives up when a lease it saw is still there
  unchanged (a holder, or an abandoned one; a contender rewrites its lease each round).
  This needs listings that show every completed write, as S3 and
  its compatibles give (read-after-write consistency for LIST); the alternative, keeping each
  save under its own prefix with the marker naming it, would change what every reader reads.

Either way a save that finds the name held or committed fails at once with
:class:`~dcp_safe.errors.CheckpointExistsError`, before writing a byte, unless the lease is one
it may take over (:mod:`dcp_safe.commit.takeover`: a fenced save finding the lease of an older
attempt of its run, or an idle one that names no attempt of its run); the marker is checked
again once the lease is held (a save that committed wrote its marker before it removed its
lease, so the check cannot miss it). The publisher checks that the lease is still its own right
before writing the marker (a stale writer whose lease was collected and retaken can never
publish), and removes it after. A lease left by a crash is taken over by the restarted job
(a newer attempt), or collected with the rest of the uncommitted prefix by the sweeper, once
nothing under the prefix changed for its grace period. A lease records its holder's attempt and
run (:meth:`~dcp_safe.commit.takeover.Claimant.body`) so that a later save can tell.

Replication to such a root takes the same lease (:func:`join_or_acquire_lease`), with the
checkpoint's own save id (its manifest's), so a replica and a direct save, or two replicas of
different checkpoints, never write under one name at once. A save id there names one
checkpoint's bytes, so a lease already holding it is shared, not refused: a retry after a crash
or a second replicator of the same checkpoint writes identical objects over identical objects.
Exclusive lease: ``_WRITING`` holding the same save id is joined. Per-save leases: an existing
``_WRITING-<save id>`` is joined when no other save's lease is beside it (one beside it means a
contention round is under way: refused, and ours is left alone, as it may be the co-holder's).
A local save never shares (:func:`acquire_lease`): its save id is its own. A replication whose
lease is of another save id takes it over on the same terms as a save.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.takeover import (
    Claimant,
    abandoned_among,
    clear_leftovers,
    held_error,
    read_holder,
    take_over_exclusive,
    takeover_candidates,
)
from dcp_safe.errors import CheckpointExistsError, StaleWriterError
from dcp_safe.untrusted import shown

__all__ = [
    "abandon_lease",
    "acquire_lease",
    "check_lease",
    "held_by_another",
    "holds_lease",
    "join_or_acquire_lease",
    "lease_acquired_at",
    "lease_files",
    "own_lease_file",
    "release_lease",
]

# Per-save leases: rounds before giving up on a name other saves keep contending for, and the
# random pause between rounds (long against one request, so that two contenders part).
_ROUNDS = 5
_PAUSE_S = (0.05, 0.5)
# An exclusive lease that vanished as we looked at it is created again this often.
_CREATE_TRIES = 2
_UNFENCED = Claimant()


def _lease_path(name: str, save_id: str | None = None) -> str:
    return f"{name}/{layout.lease_file_name(save_id)}"


def acquire_lease(
    backend: Backend, name: str, save_id: str, claimant: Claimant = _UNFENCED
) -> None:
    """Take the name for this save (rank 0, before any rank writes).

    Args:
        claimant: the save's attempt and stale-lease bound: what its lease records, and which
            lease in the way it may take over (:mod:`dcp_safe.commit.takeover`). Default: an
            unfenced save, which takes nothing over.

    Raises:
        CheckpointExistsError: the name is committed, or another save holds (or abandoned) it
            and its lease may not be taken over.
    """
    _refuse_if_committed(backend, name)
    if backend.supports_exclusive_create:
        _acquire_exclusive(backend, name, save_id, claimant)
    else:
        _acquire_per_save(backend, name, save_id, claimant)


def _acquire_exclusive(backend: Backend, name: str, save_id: str, claimant: Claimant) -> None:
    lease = _lease_path(name)
    for _ in range(_CREATE_TRIES):
        try:
            backend.write_bytes(lease, claimant.body(save_id), exclusive=True)
        except FileExistsError:
            if take_over_exclusive(backend, name, save_id, claimant):
                _clear_after_takeover(backend, name, lease, lambda rel: rel == layout.WRITING_LEASE)
                return
            continue  # the holder let go as we looked: create it again
        _refuse_if_committed(backend, name, withdraw=lease)
        return
    raise held_error(backend, name, [_holder(backend, name)])


def _clear_after_takeover(
    backend: Backend, name: str, lease: str, keep: Callable[[str], bool]
) -> None:
    """Holding ``lease`` after a takeover: refuse a committed name, else clear the leftovers.

    Only a committed name withdraws the lease. Any other failure leaves it: it keeps a save
    that would not clear them from claiming the name over the leftovers, and the next attempt
    takes it over again (or the sweeper collects the prefix).
    """
    try:
        _refuse_if_committed(backend, name)
        clear_leftovers(backend, name, keep)
    except CheckpointExistsError:
        with contextlib.suppress(OSError):
            backend.remove_file(lease)
        raise


def _acquire_per_save(backend: Backend, name: str, save_id: str, claimant: Claimant) -> None:
    own = layout.lease_file_name(save_id)
    # Judged once, before our own lease is there (it would make the prefix look busy). A lease
    # written later is a contender's or a new holder's, never one to take over.
    taken = takeover_candidates(backend, name, claimant)
    seen: dict[str, float | None] = {}
    for round_ in range(_ROUNDS):
        backend.write_bytes(f"{name}/{own}", claimant.body(save_id))
        try:
            others = set(lease_files(backend, name)) - {own} - taken
            if others and round_ == 0:
                # An abandoned lease is anyone's; an unfenced save only learns of one here,
                # so that the common case (nothing in the way) costs no listing more.
                taken |= abandoned_among(backend, name, others)
                others -= taken
            if not others:
                _refuse_if_committed(backend, name, withdraw=f"{name}/{own}")
            # A contender writes its lease anew each round (a new ``acquired_at``); a holder,
            # or an abandoned lease, does not. Both racers seeing each other twice in a row
            # must not make both give up: only a lease unchanged since the last round counts.
            stamps = {e: _acquired_at(backend, f"{name}/{e}") for e in sorted(others)}
        except BaseException:
            with contextlib.suppress(OSError):
                backend.remove_file(f"{name}/{own}")
            raise
        if not others:
            if taken:
                _clear_after_takeover(backend, name, f"{name}/{own}", _kept(own, taken))
            return
        backend.remove_file(f"{name}/{own}")
        if any(entry in seen and seen[entry] == stamp for entry, stamp in stamps.items()):
            break  # unchanged after a pause: a holder (or abandoned), not a contender
        seen = stamps
        _pause()
    raise held_error(backend, name, [_save_id_of(entry) for entry in sorted(seen)])


def _kept(own: str, taken: frozenset[str]) -> Callable[[str], bool]:
    """What a per-save takeover keeps under the name: its own lease, and any lease it did not
    take over (a contender's, which withdraws itself)."""

    def kept(rel: str) -> bool:
        return rel == own or ("/" not in rel and layout.is_lease_file(rel) and rel not in taken)

    return kept


def join_or_acquire_lease(
    backend: Backend, name: str, save_id: str, claimant: Claimant = _UNFENCED
) -> bool:
    """Take the name for save ``save_id``, or share the lease that same save already holds.

    For replication only, where ``save_id`` names the bytes being written (the checkpoint's
    manifest's), so two writers of it write identical objects (module docstring). A lease of
    another save id is taken over on the terms of :func:`acquire_lease`.

    Returns:
        True when it joined a lease of ``save_id`` that was already there (the writer that took
        it, or the sweeper, removes it); False when it took the name itself.

    Raises:
        CheckpointExistsError: the name is committed, or another save holds (or abandoned) it
            and its lease may not be taken over.
    """
    _refuse_if_committed(backend, name)
    if backend.supports_exclusive_create:
        lease = _lease_path(name)
        for _ in range(_CREATE_TRIES):
            try:
                backend.write_bytes(lease, claimant.body(save_id), exclusive=True)
            except FileExistsError:
                if _holder(backend, name) == save_id:
                    _refuse_if_committed(backend, name)  # never withdraws: the co-holder's
                    return True
                if not take_over_exclusive(backend, name, save_id, claimant):
                    continue
                _clear_after_takeover(backend, name, lease, lambda rel: rel == layout.WRITING_LEASE)
                return False
            _refuse_if_committed(backend, name, withdraw=lease)
            return False
        raise held_error(backend, name, [_holder(backend, name)])
    own = layout.lease_file_name(save_id)
    present = set(lease_files(backend, name))
    if own not in present:
        _acquire_per_save(backend, name, save_id, claimant)
        return False
    others = present - {own}
    if others:
        raise held_error(backend, name, [_save_id_of(entry) for entry in sorted(others)])
    _refuse_if_committed(backend, name)
    return True


def holds_lease(backend: Backend, name: str, save_id: str) -> bool:
    """True while the lease on ``name`` is save ``save_id``'s."""
    if backend.supports_exclusive_create:
        return _holder(backend, name) == save_id
    return backend.exists(_lease_path(name, save_id))


def held_by_another(backend: Backend, name: str, save_id: str) -> bool:
    """True when a lease of a save other than ``save_id`` (or one unreadable) is on ``name``."""
    if backend.supports_exclusive_create:
        return backend.exists(_lease_path(name)) and _holder(backend, name) != save_id
    return bool(set(lease_files(backend, name)) - {layout.lease_file_name(save_id)})


def check_lease(backend: Backend, name: str, save_id: str) -> None:
    """Raises StaleWriterError unless this save still holds the lease."""
    if holds_lease(backend, name, save_id):
        return
    holder = _holder(backend, name) if backend.supports_exclusive_create else None
    raise StaleWriterError(
        f"save {save_id} no longer holds {backend.full_path(name)} (held by {shown(holder, 64)})",
        {0: "lease lost"},
    )


def abandon_lease(backend: Backend, name: str, save_id: str, claimant: Claimant) -> None:
    """Mark this save's lease abandoned instead of removing it: a rank failed and its peers'
    objects may still be under the name, so the next save of it, of any attempt, takes the
    lease over and clears them (:mod:`dcp_safe.commit.takeover`)."""
    lease = f"{name}/{own_lease_file(backend, save_id)}"
    backend.write_bytes(lease, claimant.body(save_id, abandoned=True))


def release_lease(backend: Backend, name: str, save_id: str) -> None:
    """Remove this save's lease (after its marker, or once it failed and removed its files)."""
    backend.remove_file(f"{name}/{own_lease_file(backend, save_id)}")


def own_lease_file(backend: Backend, save_id: str) -> str:
    """The name of the lease save ``save_id`` writes under a checkpoint's folder on
    ``backend``: the one ``_WRITING``, or its own per-save lease."""
    return layout.lease_file_name(None if backend.supports_exclusive_create else save_id)


def lease_files(backend: Backend, name: str) -> list[str]:
    """The leases (of either kind) under ``<name>/``, as names."""
    return [entry for entry in backend.list_dir(name) if layout.is_lease_file(entry)]


def lease_acquired_at(backend: Backend, name: str) -> float | None:
    """When the newest readable lease on ``name`` says it was taken (the writer's clock; None:
    no lease, or none readable). The sweeper prefers the storage's own modification times."""
    stamps = [
        stamp
        for entry in lease_files(backend, name)
        if (stamp := _acquired_at(backend, f"{name}/{entry}")) is not None
    ]
    return max(stamps) if stamps else None


def _refuse_if_committed(backend: Backend, name: str, *, withdraw: str | None = None) -> None:
    if not backend.exists(f"{name}/{layout.COMMITTED_MARKER}"):
        return
    if withdraw is not None:
        backend.remove_file(withdraw)
    raise CheckpointExistsError(backend.full_path(name))


def _pause() -> None:
    time.sleep(random.uniform(*_PAUSE_S))


def _save_id_of(entry: str) -> str:
    return entry.partition("-")[2]


def _holder(backend: Backend, name: str) -> str | None:
    """The save id the one ``_WRITING`` names; None when absent or unreadable (not a small
    regular file of JSON: :mod:`dcp_safe.manifest.limits`)."""
    holder = read_holder(backend, _lease_path(name))
    return None if holder is None else holder.save_id


def _acquired_at(backend: Backend, rel: str) -> float | None:
    holder = read_holder(backend, rel)
    return None if holder is None else holder.acquired_at
