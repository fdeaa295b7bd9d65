"""The writing lease: one save at a time under a name, on storage that cannot rename.

The two kinds and the rules: docs/architecture.md, "The writing lease". :func:`acquire_lease`
is a save's (never shared); :func:`join_or_acquire_lease` is replication's.
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
    clear_leftovers,
    held_error,
    lease_acquired_at,
    lease_files,
    read_holder,
    report_takeover,
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

# Per-save leases: rounds before giving up on a contended name, and the random pause between
# rounds (long against one request, so that two contenders part).
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
        claimant: what the lease records, and which lease in the way it may take over
            (:mod:`dcp_safe.commit.takeover`). Default: an unfenced save, which takes none over.

    Raises:
        CheckpointExistsError: the name is committed, or another save holds (or abandoned) it
            and its lease may not be taken over.
    """
    _refuse_if_committed(backend, name)
    if backend.supports_exclusive_create:
        _acquire_exclusive(backend, name, save_id, claimant)
    else:
        _acquire_per_save(backend, name, save_id, claimant)


def _acquire_exclusive(
    backend: Backend, name: str, save_id: str, claimant: Claimant, *, join: bool = False
) -> bool:
    """True: joined (with ``join``) the lease save ``save_id`` already holds."""
    lease = _lease_path(name)
    for _ in range(_CREATE_TRIES):
        try:
            backend.write_bytes(lease, claimant.body(save_id), exclusive=True)
        except FileExistsError:
            if join and _holder(backend, name) == save_id:
                _refuse_if_committed(backend, name)  # never withdraws: the co-holder's
                return True
            taken = take_over_exclusive(backend, name, save_id, claimant)
            if taken is not None:
                _clear_after_takeover(backend, name, lease, lambda rel: rel == layout.WRITING_LEASE)
                report_takeover(backend, name, taken)
                return False
            continue  # the holder let go as we looked: create it again
        _refuse_if_committed(backend, name, withdraw=lease)
        return False
    raise held_error(backend, name, [_holder(backend, name)])


def _clear_after_takeover(
    backend: Backend, name: str, lease: str, keep: Callable[[str], bool]
) -> None:
    """Holding ``lease`` after a takeover: refuse a committed name, else clear the leftovers.

    Only a committed name withdraws the lease: any other failure keeps it, so that no save
    claims the name over the leftovers before the next takeover (or the sweeper) clears them.
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
            others = set(lease_files(backend, name)) - {own} - taken.keys()
            if others and round_ == 0:
                # An abandoned lease is anyone's; an unfenced save only learns of one here,
                # so that the common case (nothing in the way) costs no listing more.
                taken |= takeover_candidates(backend, name, _UNFENCED, others)
                others -= taken.keys()
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
                _clear_after_takeover(backend, name, f"{name}/{own}", _kept(own, set(taken)))
            for what in taken.values():
                report_takeover(backend, name, what)
            return
        backend.remove_file(f"{name}/{own}")
        if any(entry in seen and seen[entry] == stamp for entry, stamp in stamps.items()):
            break  # unchanged after a pause: a holder (or abandoned), not a contender
        seen = stamps
        _pause()
    raise held_error(backend, name, [_save_id_of(entry) for entry in sorted(seen)])


def _kept(own: str, taken: set[str]) -> Callable[[str], bool]:
    """What a per-save takeover keeps under the name: its own lease, and any lease it did not
    take over (a contender's, which withdraws itself)."""

    def kept(rel: str) -> bool:
        return rel == own or ("/" not in rel and layout.is_lease_file(rel) and rel not in taken)

    return kept


def join_or_acquire_lease(
    backend: Backend, name: str, save_id: str, claimant: Claimant = _UNFENCED
) -> bool:
    """Take the name for save ``save_id``, or share the lease that same save already holds.

    For replication only, where ``save_id`` is the checkpoint's own (docs/architecture.md, "The
    writing lease"); otherwise as :func:`acquire_lease`.

    Returns:
        True when it joined a lease already there (its taker, or the sweeper, removes it);
        False when it took the name itself.

    Raises:
        CheckpointExistsError: as :func:`acquire_lease`.
    """
    _refuse_if_committed(backend, name)
    if backend.supports_exclusive_create:
        return _acquire_exclusive(backend, name, save_id, claimant, join=True)
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
    """Mark this save's lease abandoned instead of removing it, for the next save of the name
    to take over and clear the peers' objects (docs/architecture.md, "What failed saves leave")."""
    lease = f"{name}/{own_lease_file(backend, save_id)}"
    backend.write_bytes(lease, claimant.body(save_id, abandoned=True))


def release_lease(backend: Backend, name: str, save_id: str) -> None:
    """Remove this save's lease (after its marker, or once it failed and removed its files)."""
    backend.remove_file(f"{name}/{own_lease_file(backend, save_id)}")


def own_lease_file(backend: Backend, save_id: str) -> str:
    """The name of the lease save ``save_id`` writes under a checkpoint's folder on
    ``backend``: the one ``_WRITING``, or its own per-save lease."""
    return layout.lease_file_name(None if backend.supports_exclusive_create else save_id)


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
