"""Admission of one save request: the decision every rank takes from every rank's :class:`Vote`.

:class:`~dcp_safe.manager.saving.SaveRunner` casts this rank's vote, waits and starts the save.

``when_busy="wait"`` waits with every rank, in rounds, up to ``wait_timeout_s``, then skips
(``force=True``: raises); a save in flight past ``latency_objective_s`` means the storage is
stuck, so the request is skipped at once rather than queued behind it. With a checkpoint worker
each rank votes whether its worker is ready; a request that finds none started starts it, after
the vote (which replaces a broken workers' group), without waiting for it.

Every rank decides the same: :func:`decide` is a pure function of every rank's vote, from one
exchange per request; the rules are in docs/multirank.md ("The manager under torchrun", "When
one rank is slow"). Whether ``maybe_save`` requests a save at all is decided before, by the
cadence's own vote (:mod:`.cadence`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from dcp_safe.coordination.agreement import Vote, require_same_call
from dcp_safe.coordination.groups import WORKERS
from dcp_safe.manager.handles import BusyPolicy


class Verdict(str, enum.Enum):
    """What every rank does with the request."""

    START = "start"
    SKIP = "skip"
    RAISE = "raise"
    SYNC = "sync"
    COALESCE = "coalesce"
    WAIT = "wait"


@dataclass(frozen=True)
class Decision:
    """The verdict, why, the agreed fallback reason (naming the ranks that tripped), and
    whether a save started for it runs in the checkpoint workers (``worker``) or on the
    thread path: the two save over different groups, so every rank must take the same one."""

    verdict: Verdict
    reason: str = ""
    fallback: str | None = None
    worker: bool = False


def decide(votes: Sequence[Vote], policy: BusyPolicy) -> Decision:
    """The decision every rank takes for one request, from every rank's vote (index = rank).

    A save runs in the workers only when every rank's is ready and no rank saw their group
    break (the vote replaces it: new workers, not ready yet); until then on the thread path,
    so no save waits for a worker to start.

    Raises:
        ConfigError: the ranks are in different calls or ask for different steps.
    """
    decision = _decide(votes, policy)
    ready = all(v.worker_ready and WORKERS not in v.broken for v in votes)
    return dataclasses.replace(decision, worker=ready)


def _decide(votes: Sequence[Vote], policy: BusyPolicy) -> Decision:
    require_same_call(votes)
    tripped = [(r, v.fallback) for r, v in enumerate(votes) if v.fallback is not None]
    if tripped:
        reason = "; ".join(f"rank {r}: {why}" for r, why in tripped)
        return Decision(Verdict.SYNC, reason, fallback=reason)
    stalled = [(r, v.stalled) for r, v in enumerate(votes) if v.stalled is not None]
    if stalled:
        reason = "; ".join(f"rank {r}: {why}" for r, why in stalled)
        return Decision(Verdict.RAISE if policy is BusyPolicy.RAISE else Verdict.SKIP, reason)
    busy = [r for r, v in enumerate(votes) if v.busy]
    if not busy:
        return Decision(Verdict.START)
    who = _ranks(busy)
    if policy is BusyPolicy.COALESCE:
        if len({v.pending for v in votes}) > 1:
            starting = _ranks([r for r, v in enumerate(votes) if v.pending is None])
            return Decision(
                Verdict.SKIP, f"coalesce: the pending save is already starting on {starting}"
            )
        short = [r for r, v in enumerate(votes) if v.no_room]
        if short:
            return Decision(
                Verdict.SKIP, f"coalesce: no memory for a pending copy on {_ranks(short)}"
            )
        return Decision(Verdict.COALESCE, f"a save is in flight on {who}")
    verdict = Verdict(policy.value)  # wait, skip, raise, sync: each names its verdict
    return Decision(verdict, f"busy: a save is in flight on {who} (when_busy={policy.value!r})")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
