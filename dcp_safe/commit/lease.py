"""The writing lease: one save at a time under a name, on storage that cannot rename; and
taking over a lease that a crashed or fenced writer left behind (docs/architecture.md, "The
writing lease" and "Taking over a lease"). A lease lacking a field (an older dcp_safe, an
unfenced writer) is still read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.s3_upload import abort_stale_uploads
from dcp_safe.commit.fencing import Attempt
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    ConfigError,
    StaleWriterError,
)
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, parse_json
from dcp_safe.untrusted import shown

#: How long nothing under a name must have changed before a lease that names no attempt of this
#: run may be taken over (by a fenced save): well under the sweeper's 6 h grace period.
DEFAULT_STALE_LEASE_S = 3600.0
# Rounds of a takeover (the lease changed hands while we judged it), and takeover records
# followed (one per takeover that died half-way): far more than a real root ever needs.
_MAX_ROUNDS = 4
_MAX_RECORDS = 8

log = logging.getLogger(__name__)

#: Called after each takeover with the root's backend, the name and what was taken over and why.
#: :mod:`dcp_safe.checkpoints.history` adds the one that records it in the root's history: it
#: is a layer above this one, so it registers itself, as a logging handler does.
TAKEOVER_HOOKS: list[Callable[[Backend, str, str], None]] = []


@dataclass(frozen=True, kw_only=True)
class Claimant:
    """Who claims a name, as its lease records it, and when it takes a lease over.

    ``attempt`` None: an unfenced save, which never takes over. ``stale_after_s``: how long a
    prefix whose lease names no attempt of this run must have been idle before it is taken
    over (sooner when idle since this job started: a relaunch); None: never.
    """

    attempt: Attempt | None = None
    stale_after_s: float | None = DEFAULT_STALE_LEASE_S

    def __post_init__(self) -> None:
        stale = self.stale_after_s
        if stale is not None and (
            isinstance(stale, bool) or not isinstance(stale, (int, float)) or not stale >= 0
        ):
            raise ConfigError(f"stale_after_s must be a number >= 0 or None, got {stale!r}")

    def body(self, save_id: str, *, abandoned: bool = False) -> bytes:
        """The lease (or takeover record) this claimant writes for save ``save_id``; with
        ``abandoned``, the lease of a save that failed with its peers' objects left behind."""
        fields: dict[str, object] = {"save_id": save_id, "acquired_at": time.time()}
        if self.attempt is not None:
            fields.update(attempt=self.attempt.number, run_id=self.attempt.run_id)
        if abandoned:
            fields["abandoned"] = True
        return json.dumps(fields).encode()

    def why_take_over(self, holder: LeaseHolder, quiet: Quiet) -> str | None:
        """What ``holder``'s lease is, and why this claimant may take it over; None: it may not.
        ``quiet`` is asked only when the answer depends on it."""
        if holder.abandoned:
            return f"{holder}: its save abandoned it"
        if self.attempt is None:
            return None
        if holder.attempt is not None and holder.run_id == self.attempt.run_id:
            if holder.attempt < self.attempt.number:
                return f"{holder}: an older attempt than this one ({self.attempt.number})"
            return None
        if self.stale_after_s is None:
            return None
        idle = None if quiet.changed is None else time.time() - quiet.changed
        if idle is not None and idle >= self.stale_after_s:
            return f"{holder}: nothing under the name changed for {idle:.0f} s"
        if quiet.before(self.attempt):
            # A relaunch (a new run id, so no attempt rule): a writer that changed nothing
            # since this job started is its previous run's, and gone (docs/faults.md).
            return f"{holder}: nothing under the name changed since this job started"
        return None


@dataclass(frozen=True)
class LeaseHolder:
    """What a lease (or a takeover record) says of its holder; a field it lacks is None."""

    raw: bytes
    save_id: str | None = None
    attempt: int | None = None
    run_id: str | None = None
    acquired_at: float | None = None
    abandoned: bool = False

    def __str__(self) -> str:
        run = "" if self.run_id is None else f" of run {shown(self.run_id, 64)}"
        attempt = "" if self.attempt is None else f", attempt {self.attempt}"
        return f"the lease of save {self.save_id or '(unnamed)'}{run}{attempt}"

    @property
    def record_name(self) -> str:
        """The takeover record for this holder's lease: named after its save id, or (a lease
        that names none a file name can carry) a digest of its bytes, the same for every
        reader of the same lease."""
        if self.save_id is not None:
            with contextlib.suppress(ValueError):
                return layout.takeover_record_name(self.save_id)
        return layout.takeover_record_name(hashlib.sha256(self.raw).hexdigest()[:32])


def read_holder(backend: Backend, rel: str) -> LeaseHolder | None:
    """The holder the lease (or record) at ``rel`` names; None when it is absent.

    A lease that is not a small regular file of JSON is a holder with no fields, which only the
    idle rule can take over. A save id not as :func:`~dcp_safe.layout.is_save_id` accepts is
    read as none, since a lease's text reaches messages and history events.
    """
    raw = b""
    fields = None
    try:
        raw = backend.read_small(rel, CONTROL_MAX_BYTES)
        fields = parse_json(raw, backend.full_path(rel))
    except FileNotFoundError:
        return None
    except CheckpointCorruptError:
        pass
    if not isinstance(fields, dict):
        return LeaseHolder(raw=raw)

    def typed(key: str, kind: type | tuple[type, ...]) -> Any:
        value = fields.get(key)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    stamp, save_id = typed("acquired_at", (int, float)), fields.get("save_id")
    return LeaseHolder(
        raw=raw,
        save_id=save_id if layout.is_save_id(save_id) else None,
        attempt=typed("attempt", int),
        run_id=typed("run_id", str),
        acquired_at=None if stamp is None else float(stamp),
        abandoned=fields.get("abandoned") is True,
    )


def last_change(backend: Backend, name: str, now: float) -> float | None:
    # By the storage's clock; else what its newest lease says, if not in the future.
    if (changed := backend.modified_at(name)) is not None:
        return changed
    newest = lease_acquired_at(backend, name)
    return newest if newest is not None and newest <= now else None


def lease_acquired_at(backend: Backend, name: str) -> float | None:
    """When the newest readable lease on ``name`` says it was taken (the writer's clock). The
    sweeper prefers the storage's own modification times."""
    holders = [read_holder(backend, f"{name}/{entry}") for entry in lease_files(backend, name)]
    return max((h.acquired_at for h in holders if h and h.acquired_at is not None), default=None)


def lease_files(backend: Backend, name: str) -> list[str]:
    return [entry for entry in backend.list_dir(name) if layout.is_lease_file(entry)]


def _take_over_exclusive(
    backend: Backend, name: str, save_id: str, claimant: Claimant
) -> str | None:
    """Take ``name``'s one ``_WRITING`` lease over for save ``save_id`` (after creating it
    exclusively failed), if ``claimant`` may: what was taken over and why; None when no lease
    is there any more (the caller creates it again); CheckpointExistsError when it may not be
    taken over, or another save took it first. The caller then clears the leftovers."""
    lease = f"{name}/{layout.WRITING_LEASE}"
    for _ in range(_MAX_ROUNDS):
        holder = read_holder(backend, lease)
        if holder is None:
            return None
        why = claimant.why_take_over(holder, Quiet(backend, name))
        if why is None:
            raise _held_error(backend, name, [holder.save_id])
        record = _win_record(backend, name, holder, save_id, claimant)
        current = read_holder(backend, lease)
        if current is not None and current.raw == holder.raw:
            backend.write_bytes(lease, claimant.body(save_id))
            return why
        # It changed hands while we won the record (released, or taken by a newer attempt):
        # judge the lease there now. Our record goes, so the name is not left looking taken.
        backend.remove_file(record)
    raise _held_error(backend, name, [None])


def _takeover_candidates(
    backend: Backend, name: str, claimant: Claimant, entries: Collection[str] | None = None
) -> dict[str, str]:
    """The leases under ``<name>/`` (names: ``entries``, else every lease there now) that
    ``claimant`` may take over, each with what it is and why: with one lease per save, those
    left out of the contention round. An unfenced claimant lists nothing: it judges only the
    leases in its way (any save may take over an abandoned one)."""
    if entries is None:
        entries = lease_files(backend, name) if claimant.attempt is not None else ()
    quiet = Quiet(backend, name)
    return {
        entry: why
        for entry in entries
        if (holder := read_holder(backend, f"{name}/{entry}")) is not None
        and (why := claimant.why_take_over(holder, quiet)) is not None
    }


def _report_takeover(backend: Backend, name: str, what: str) -> None:
    log.warning("took the name %s over from %s", backend.full_path(name), what)
    for hook in TAKEOVER_HOOKS:
        try:
            hook(backend, name, what)
        except Exception as exc:  # the takeover stands: its record is bookkeeping
            log.warning("could not record the takeover of %s: %s", name, shown(exc, 300))


def _held_error(
    backend: Backend, name: str, holders: Sequence[str | None]
) -> CheckpointExistsError:
    ids = ", ".join(shown(h, 64) for h in holders) or "another save"
    return CheckpointExistsError(
        backend.full_path(name),
        f"save {ids} is writing it (or left it: a newer attempt of its run takes it over, a"
        " relaunched job once nothing under the name has changed since the relaunch started,"
        " otherwise the sweeper collects it after its grace period)",
    )


def _win_record(
    backend: Backend, name: str, holder: LeaseHolder, save_id: str, claimant: Claimant
) -> str:
    """Create the takeover record for ``holder``'s lease exclusively; returns its path. One
    already there is another save's takeover: refused unless ``claimant`` may take that one over
    too (a takeover that died half-way), then the record named after it is next."""
    target = holder
    for _ in range(_MAX_RECORDS):
        rel = f"{name}/{target.record_name}"
        try:
            backend.write_bytes(rel, claimant.body(save_id), exclusive=True)
            return rel
        except FileExistsError:
            other = read_holder(backend, rel)
            if other is None:
                continue  # removed meanwhile by the save that won it: try again
            if claimant.why_take_over(other, Quiet(backend, name)) is None:
                raise _held_error(backend, name, [other.save_id]) from None
            target = other
    raise _held_error(backend, name, [None])


@dataclass
class Quiet:
    """When anything under ``<name>/`` last changed, read once, and only if a rule asks."""

    backend: Backend
    name: str

    @functools.cached_property
    def changed(self) -> float | None:
        return last_change(self.backend, self.name, time.time())

    def before(self, attempt: Attempt) -> bool:
        """Whether nothing under the name changed since ``attempt`` started under this root:
        its attempt record's modification time (written once, by its rank 0's first claim under
        the root) against the name's, both by the storage's clock, never a writer's. Equal
        times (a store counting whole seconds) are not before."""
        started = self.backend.modified_at(attempt.marker)
        changed = self.backend.modified_at(self.name)
        return started is not None and changed is not None and changed < started


# Per-save leases: rounds before giving up on a contended name, and the random pause between
# rounds (long against one request, so that two contenders part).
_ROUNDS = 5
_PAUSE_S = (0.05, 0.5)
# An exclusive lease that vanished as we looked at it is created again this often.
_CREATE_TRIES = 2
_UNFENCED = Claimant()


def acquire_lease(
    backend: Backend, name: str, save_id: str, claimant: Claimant = _UNFENCED, *, join: bool = False
) -> bool:
    """Take the name for this save (rank 0, before any rank writes); with ``join``, or share
    the lease this same save already holds: replication's, where ``save_id`` is the
    checkpoint's own. ``claimant``: what the lease records, and which lease in the way it may
    take over. True: it joined a lease already there (its taker, or the sweeper, removes it).
    CheckpointExistsError: the name is committed, or another save holds (or abandoned) it and
    its lease may not be taken over."""
    _refuse_if_committed(backend, name)
    if backend.exists(f"{name}/{layout.TRASH_MARKER}"):  # its files would mix with this save's
        raise CheckpointExistsError(
            backend.full_path(name),
            "in the trash: restore it (dcp-safe gc --restore) or let trash_grace_s delete it",
        )
    if backend.supports_exclusive_create:
        return _acquire_exclusive(backend, name, save_id, claimant, join=join)
    own = layout.lease_file_name(save_id)
    present = set(lease_files(backend, name)) if join else set()
    if own not in present:
        _acquire_per_save(backend, name, save_id, claimant)
        return False
    if others := present - {own}:
        raise _held_error(backend, name, [_save_id_of(entry) for entry in sorted(others)])
    _refuse_if_committed(backend, name)
    return True


def _acquire_exclusive(
    backend: Backend, name: str, save_id: str, claimant: Claimant, *, join: bool = False
) -> bool:
    lease = f"{name}/{layout.WRITING_LEASE}"
    for _ in range(_CREATE_TRIES):
        try:
            backend.write_bytes(lease, claimant.body(save_id), exclusive=True)
        except FileExistsError:
            if join and _holder(backend, name) == save_id:
                _refuse_if_committed(backend, name)  # never withdraws: the co-holder's
                return True
            taken = _take_over_exclusive(backend, name, save_id, claimant)
            if taken is not None:
                _clear_after_takeover(backend, name, lease, lambda rel: rel == layout.WRITING_LEASE)
                _report_takeover(backend, name, taken)
                return False
            continue  # the holder let go as we looked: create it again
        _refuse_if_committed(backend, name, withdraw=lease)
        return False
    raise _held_error(backend, name, [_holder(backend, name)])


def _clear_after_takeover(
    backend: Backend, name: str, lease: str, keep: Callable[[str], bool]
) -> None:
    """Holding ``lease`` after a takeover: refuse a committed name (the taken-over writer
    published in the round trip after its last check), else remove what the taken-over save
    left under ``<name>/``: every object ``keep`` (given its path relative to ``<name>/``)
    refuses, and every incomplete multipart upload there (none is this save's: it clears before
    any of its ranks writes). The one listing shows the marker and the leftovers at once.

    Only a committed name withdraws the lease: any other failure keeps it, so that no save
    claims the name over the leftovers before the next takeover (or the sweeper) clears them.
    """
    try:
        files = list(backend.walk_files(name))
        if layout.COMMITTED_MARKER in files:
            raise CheckpointExistsError(
                backend.full_path(name), "it got committed during a takeover"
            )
        for rel in files:
            if not keep(rel):
                backend.remove_file(f"{name}/{rel}")
        # Whatever their age: an infinite "now" makes every upload old enough, one without a
        # start time included.
        abort_stale_uploads(backend, older_than_s=0, now=math.inf, collected=(name,), only=name)
    except CheckpointExistsError:
        with contextlib.suppress(OSError):
            backend.remove_file(lease)
        raise


def _acquire_per_save(backend: Backend, name: str, save_id: str, claimant: Claimant) -> None:
    own = layout.lease_file_name(save_id)
    # Judged once, before our own lease is there (it would make the prefix look busy). A lease
    # written later is a contender's or a new holder's, never one to take over.
    taken = _takeover_candidates(backend, name, claimant)
    seen: dict[str, float | None] = {}
    for round_ in range(_ROUNDS):
        backend.write_bytes(f"{name}/{own}", claimant.body(save_id))
        try:
            others = set(lease_files(backend, name)) - {own} - taken.keys()
            if others and round_ == 0:
                # An abandoned lease is anyone's; an unfenced save only learns of one here,
                # so that the common case (nothing in the way) costs no listing more.
                taken |= _takeover_candidates(backend, name, _UNFENCED, others)
                others -= taken.keys()
            if not others:
                _refuse_if_committed(backend, name, withdraw=f"{name}/{own}")
            # A contender writes its lease anew each round (a new ``acquired_at``); a holder,
            # or an abandoned lease, does not. Both racers seeing each other twice in a row
            # must not make both give up: only a lease unchanged since the last round counts.
            holders = {e: read_holder(backend, f"{name}/{e}") for e in sorted(others)}
            stamps = {e: None if h is None else h.acquired_at for e, h in holders.items()}
        except BaseException:
            with contextlib.suppress(OSError):
                backend.remove_file(f"{name}/{own}")
            raise
        if not others:
            if taken:
                # Kept: its own lease, and any lease it did not take over (a contender's,
                # which withdraws itself). Called at once, so ``taken`` is this round's.
                def keep(rel: str) -> bool:
                    lease = "/" not in rel and layout.is_lease_file(rel)
                    return rel == own or (lease and rel not in taken)  # noqa: B023

                _clear_after_takeover(backend, name, f"{name}/{own}", keep)
            for what in taken.values():
                _report_takeover(backend, name, what)
            return
        backend.remove_file(f"{name}/{own}")
        if any(entry in seen and seen[entry] == stamp for entry, stamp in stamps.items()):
            break  # unchanged after a pause: a holder (or abandoned), not a contender
        seen = stamps
        _pause()
    raise _held_error(backend, name, [_save_id_of(entry) for entry in sorted(seen)])


def holds_lease(backend: Backend, name: str, save_id: str) -> bool:
    if backend.supports_exclusive_create:
        return _holder(backend, name) == save_id
    return backend.exists(f"{name}/{layout.lease_file_name(save_id)}")


def held_by_another(backend: Backend, name: str, save_id: str) -> bool:
    """True when a lease of a save other than ``save_id`` (or one unreadable) is on ``name``."""
    if backend.supports_exclusive_create:
        holder = read_holder(backend, f"{name}/{layout.WRITING_LEASE}")
        return holder is not None and holder.save_id != save_id
    return bool(set(lease_files(backend, name)) - {layout.lease_file_name(save_id)})


def check_lease(backend: Backend, name: str, save_id: str) -> None:
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
    backend.remove_file(f"{name}/{own_lease_file(backend, save_id)}")


def own_lease_file(backend: Backend, save_id: str) -> str:
    # The one ``_WRITING``, or the save's own per-save lease.
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
    holder = read_holder(backend, f"{name}/{layout.WRITING_LEASE}")
    return None if holder is None else holder.save_id
