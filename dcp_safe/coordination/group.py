"""The process group dcp_safe's collectives run on, and what a failure on it means.

:func:`checkpoint_group` makes one dedicated gloo group per default group and deadline: its
timeout is the save's deadline, it never shares a communicator with training, and gloo works on
CPU tensors whatever the training backend. Why, and the rule that every rank makes the first call
at the same point: docs/multirank.md, "Deadlines, and why saves get their own process group".

:func:`collective_failure` turns a transport error into a :class:`~dcp_safe.errors.CommitError`
naming the failed ranks, with storage as the witness: the ranks whose ``_ranks/`` manifest is
missing are the ones that died or hung (gloo names a peer's address, not its rank). The group is
then discarded: a gloo group with a dead member cannot be used again. :func:`typed_failures`
does both around a block of collectives.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dcp_safe.choices import seconds
from dcp_safe.errors import CommitError, ConfigError

DEFAULT_DEADLINE_S = 120.0
"""Well under the usual process-group timeout (30 min), well over a healthy save's collectives."""

_lock = threading.Lock()
# (id of the default group, timeout, purpose) -> (that default group, our group). The default
# group is held so its id cannot be reused by a later one while the entry exists.
_groups: dict[tuple[int, float, str], tuple[object, dist.ProcessGroup]] = {}


@atexit.register
def _forget_groups() -> None:
    # Process groups held here past the job's destroy_process_group() would otherwise be
    # destroyed during interpreter finalization, where gloo's threads can abort the process;
    # dropping them at exit, while the interpreter is whole, leaves c10d to release them.
    with _lock:
        _groups.clear()


def validate_deadline(deadline_s: object) -> float:
    return seconds("deadline_s", deadline_s)


def checkpoint_group(
    timeout_s: float = DEFAULT_DEADLINE_S, *, purpose: str = "save"
) -> dist.ProcessGroup:
    """The dedicated gloo group for checkpoint collectives, with ``timeout_s`` as its deadline.

    Call order: on every rank of the default group at the same point (the first call for a
    given ``timeout_s`` and ``purpose`` runs ``dist.new_group``, a collective); from the
    training thread, as DCP's own calls are. Cached until :func:`discard_group` or a new
    default group.

    ``purpose`` names a separate group for collectives that may run concurrently (a background
    save, the manager's votes): a communicator carries one ordered stream of collectives.

    Raises:
        ConfigError: ``timeout_s`` is not a positive number, or no default group exists.
    """
    timeout_s = validate_deadline(timeout_s)
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("checkpoint_group() needs an initialized default process group")
    default = dist.distributed_c10d._get_default_group()
    key = (id(default), timeout_s, purpose)
    with _lock:
        cached = _groups.get(key)
        if cached is not None and cached[0] is default:
            return cached[1]
        # Of every rank of the default group (no ranks=): a group on this rank too.
        group: dist.ProcessGroup = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout_s)
        )
        _groups[key] = (default, group)
        return group


def deadline_of(group: Any) -> float | None:
    """The deadline of ``group`` if it is one of dcp_safe's groups."""
    with _lock:
        return next((t for (_, t, _), (_, cached) in _groups.items() if cached is group), None)


def discard_group(group: Any, *, destroy: bool = True) -> None:
    """Forget ``group`` and tear it down: a peer failed, so its connections are dead.

    Destroying it also wakes peers still blocked on it; the next :func:`checkpoint_group` call
    creates a fresh group (a collective again). ``destroy=False`` only forgets it, for a group
    another thread may still be using (destroying one under a running collective is unsafe).
    """
    with _lock:
        stale = [key for key, (_, cached) in _groups.items() if cached is group]
        for key in stale:
            del _groups[key]
    if stale and destroy and dist.is_initialized():
        # Already gone with its default group: then nothing is left to close.
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group(group)


def gather_objects(value: object, group: Any) -> list[Any]:
    """Every rank's ``value``, by rank in ``group`` (a collective: every rank of it calls this).

    A failed peer raises the transport's error; :func:`collective_failure` translates it.
    """
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def broadcast_object(value: object, group: Any) -> Any:
    """The ``value`` of ``group``'s first rank, on every rank of it."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


# What gloo's and the store's errors say: gloo raises plain RuntimeError, so only the text tells
# it from a local error; after a timeout, later calls fail with "Application timeout caused pair
# closure", which names neither gloo nor a peer.
_TRANSPORT_WORDS = (
    "gloo",
    "connection closed",
    "connection reset",
    "timed out",
    "broken pipe",
    "pair closure",
    "application timeout",
)


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` is the transport's report of a dead or unresponsive peer."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return False
    text = str(exc).lower()
    return any(word in text for word in _TRANSPORT_WORDS)


def is_group_failure(exc: BaseException | None) -> bool:
    """True when ``exc`` or an error it was raised from is a failed collective.

    A peer's storage failure is not one (DCP reports it through working collectives); a
    timed-out or lost connection is, and the group cannot be used again.
    """
    seen = 0
    while exc is not None and seen < 16:  # a bounded walk: chains can be cyclic
        if is_collective_failure(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def collective_failure(
    exc: BaseException,
    *,
    rank: int,
    world_size: int,
    deadline_s: float | None,
    witnesses: Iterable[object] = (),
    operation: str = "save",
) -> CommitError:
    """A CommitError for a collective that failed because a peer died or hung (``exc``, chained
    as ``__cause__``).

    ``witnesses``: the save's storage writer or reader; any with ``missing_ranks()`` names the
    ranks that did not finish. ``operation``: ``"save"``, ``"load"`` or ``"vote"`` (the
    manager's), so that a failed load is not reported as an unpublished save.
    """
    missing = _missing_ranks(witnesses)
    why = (
        f"did not finish its part of the {operation}"
        if missing
        else "failed or unreachable; this rank cannot tell which peer"
    )
    within = f" within the {deadline_s:g} s deadline" if deadline_s is not None else ""
    outcome, intact = _OUTCOMES.get(operation, _OUTCOMES["save"])
    message = f"{outcome}: a peer died or did not respond{within}; restart the job ({intact})"
    error = peers_failed(message, why, exc, rank=rank, world_size=world_size, ranks=missing)
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def typed_failures(
    group: Any,
    *,
    deadline_s: float | None,
    operation: str = "save",
    forget: Callable[[BaseException], object] | None = None,
) -> Iterator[None]:
    """The block's collectives on ``group``: a peer that died or hung raises
    :func:`collective_failure`'s CommitError (from the transport's error) after ``forget(exc)``
    (by default the group is discarded: it is dead); any other error passes unchanged.

    The rank and world size are read before the block: after a failure the group may be torn
    down.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    try:
        yield
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        error = collective_failure(
            exc, rank=rank, world_size=world_size, deadline_s=deadline_s, operation=operation
        )
        if forget is None:
            discard_group(group)
        else:
            forget(exc)
        raise error from exc


def peers_failed(
    message: str,
    why: str,
    exc: BaseException,
    *,
    rank: int,
    world_size: int,
    ranks: Iterable[int] = (),
) -> CommitError:
    """A CommitError for peers that did not take part: ``ranks`` (else every peer of ``rank``),
    each with ``why`` and the first line of the transport's error (chain it: ``raise ... from
    exc``)."""
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0][:200] if text else ''}"
    named = list(ranks) or [r for r in range(world_size) if r != rank]
    return CommitError(message, {r: f"{why} ({detail})" for r in named})


# What failed, and what is still intact, per operation a failed collective was part of.
_OUTCOMES = {
    "save": ("save was not published", "the previous checkpoint is intact"),
    "load": ("load did not complete", "the checkpoint is intact; the state may be partly loaded"),
    "vote": ("the ranks could not agree", "the previous checkpoint is intact"),
}


# A peer that is alive but slower than this rank may still be writing its rank manifest when
# the dead peer's connection drops: the witness is read until it stops changing, so that only
# the ranks that really stopped are named (bounded: a failed save must fail in time).
_SETTLE_S = 0.5
_SETTLE_LIMIT_S = 5.0


def _missing_ranks(witnesses: Iterable[object]) -> list[int]:
    for witness in witnesses:
        probe = getattr(witness, "missing_ranks", None)
        if probe is None:
            continue
        try:
            missing = _settled(probe)
        except (OSError, ValueError):
            continue  # storage failing too: fall back to naming every peer
        if missing:
            return sorted(missing)
    return []


def _settled(probe: Callable[[], list[int] | None]) -> list[int] | None:
    missing = probe()
    give_up = time.monotonic() + _SETTLE_LIMIT_S
    steady_since = time.monotonic()
    while missing and time.monotonic() < give_up:
        time.sleep(0.05)
        again = probe()
        if again != missing:
            missing, steady_since = again, time.monotonic()
        elif time.monotonic() - steady_since >= _SETTLE_S:
            break
    return missing
