"""Admission of one save request: this rank's :class:`Vote`, the agreed decision, bounded waits.

``when_busy="wait"`` waits with every rank, in rounds, up to ``wait_timeout_s``, then skips
(``force=True``: raises); a save in flight past ``latency_objective_s`` means the storage is
stuck, so the request is skipped at once rather than queued behind it. With a checkpoint worker
each rank votes whether its worker is ready; a request that finds none started starts it, after
the vote (which replaces a broken workers' group), without waiting for it.

Every rank decides the same: :func:`decide` is a pure function of every rank's vote, from one
exchange per request; the rules are in docs/multirank.md ("The manager under torchrun", "When
one rank is slow").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcp_safe.coordination.agreement import Agreement, Vote, require_same_call
from dcp_safe.coordination.groups import WORKERS
from dcp_safe.manager.handles import BusyPolicy, SaveHandle
from dcp_safe.staging._tree import collect_tensors

if TYPE_CHECKING:
    from dcp_safe.manager.saving import SaveRunner

__all__ = ["Admitter", "Decision", "Verdict", "decide"]


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


@dataclass(kw_only=True, eq=False)
class Admitter:
    """Turns a request into the decision every rank takes (``latency_objective_s=None``: not
    checked; the stager's budget bounds a coalesced copy; ``worker``: the process executor's)."""

    agreement: Agreement
    runner: SaveRunner  # its slot, switch, stager and worker
    wait_timeout_s: float
    latency_objective_s: float | None

    def admit(
        self, handle: SaveHandle, policy: BusyPolicy, state_dict: dict[str, Any], *, force: bool
    ) -> Decision:
        """The decision for ``handle``; ``START`` means the slot is free now on every rank.

        ``WAIT`` is returned as it is: the caller resolves it with :meth:`wait`, outside the
        slot's freeze (the wait is for the slot to free up).

        Raises:
            ConfigError: the ranks asked for different steps.
            CommitError: a peer died or did not answer within the deadline.
        """
        fallback = self.runner.switch.on_request(handle, self._leaked_bytes)
        busy = not self.runner.slot.idle()
        ready = self.runner.worker is not None and self.runner.worker.ready
        vote = Vote(
            "save",
            handle.step,
            busy=busy,
            fallback=fallback,
            no_room=busy and policy is BusyPolicy.COALESCE and self._no_room(state_dict),
            stalled=None if force else self._stalled(),
            pending=self.runner.slot.pending_step(),
            worker_ready=ready,
        )
        decision = decide(self.agreement.gather(vote), policy)
        if self.runner.worker is not None and not decision.worker:
            self.runner.worker.start()
        self.runner.switch.follow(handle, decision.fallback)
        return decision

    def wait(self, handle: SaveHandle, *, force: bool, worker: bool = False) -> Decision:
        """Wait with every rank until no rank has a save in flight, or ``wait_timeout_s``
        (``worker``: the request's agreed path, kept for the start)."""
        step = handle.step
        still = self.agreement.until_all(
            "wait", step, self.runner.slot.wait_free, self.wait_timeout_s
        )
        if not still:
            return Decision(Verdict.START, worker=worker)
        self.runner.switch.ledger.count("waits_expired")
        ranks = ", ".join(map(str, still))
        reason = (
            f"waited {self.wait_timeout_s:g} s (wait_timeout_s) and a save was still in flight"
            f" on rank(s) {ranks}"
        )
        return Decision(Verdict.RAISE if force else Verdict.SKIP, reason)

    def _leaked_bytes(self) -> int:
        """Staging bytes in use while no save is in flight (the fallback's trigger c)."""
        # Idle first, stats second: only the training thread starts saves, so once idle, what
        # the stager still has in use was leaked by a finished save, not leased by a new one.
        if not self.runner.slot.idle():
            return 0
        stats = self.runner.stager.stats()
        return stats.in_use_bytes - stats.kept_bytes  # keep_in_memory's copy is no leak

    def _stalled(self) -> str | None:
        age = self.runner.slot.age_s()
        objective = self.latency_objective_s
        if age is None or objective is None or age <= objective:
            return None
        return f"the save in flight is {age:.1f} s old, over latency_objective_s={objective:g}"

    def _no_room(self, state_dict: dict[str, Any]) -> bool:
        need = sum(t.nbytes for t in collect_tensors(state_dict))
        pending = self.runner.slot.pending  # the copy it replaces is alive while this one is taken
        held = pending.nbytes if pending is not None else 0
        room = (
            self.runner.stager.budget.envelope_bytes - self.runner.stager.stats().pool_bytes - held
        )
        return need > room
