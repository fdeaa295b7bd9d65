"""When :meth:`~dcp_safe.CheckpointManager.maybe_save` saves: every N steps, by time,
continuously, and at the first step.

:func:`due` is the schedule: a pure function of the policy, the step and every rank's vote.
:class:`Cadence` is what one rank adds: its own clock's readings, cast in one vote per step
that could save (a multiple of ``every``) when the policy is timed; a step-only policy
exchanges nothing, its answer being the same on every rank already.

Which clock decides: the coordinator's (rank 0's). Every rank sends how long ago, on its own
clock, the last save committed and the last one it started began, and the decision reads rank
0's. Each interval is then measured on one clock, the one whose host writes the history, so
the history's times show the interval asked for. The largest or smallest reading would do as
well for agreement, but an order statistic of N clocks drifts with N: the one outlier rank of
a thousand (a slewed clock, a stalled VM) would set every rank's cadence. No rank waits on
another's clock: each reads its own once per vote and never polls it; the other ranks' readings
travel for the record only.

Why a save in flight on any rank means "not due": it resets the clock when it commits, and
``when_busy`` would otherwise stall training behind it (``"wait"``) or count a skip at every
step until it commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dcp_safe.coordination.agreement import Agreement, Vote, require_same_call
from dcp_safe.manager.goodput import Costs, Goodput, agree, choose
from dcp_safe.manager.slot import SaveSlot

if TYPE_CHECKING:
    from dcp_safe.manager.handles import SaveHandle
    from dcp_safe.manager.ledger import Ledger
    from dcp_safe.manager.options import SavePolicy

log = logging.getLogger("dcp_safe.manager")


@dataclass(frozen=True)
class Reading:
    """One rank's clock at a vote, in seconds.

    Attributes:
        since_commit_s: since the last save committed (or the manager was built).
        since_start_s: since the last save this cadence started (``None``: none yet).
        costs: what a save costs, as this rank measured it (:mod:`dcp_safe.manager.goodput`).
    """

    since_commit_s: float
    since_start_s: float | None = None
    costs: Costs = field(default_factory=Costs)


def timed(policy: SavePolicy) -> bool:
    """Whether ``policy`` needs the ranks' clocks (a vote per step that could save)."""
    return policy.interval_s is not None or policy.continuous or policy.auto


def due(policy: SavePolicy, step: int, first: bool, votes: Sequence[Vote]) -> str | None:
    """Why ``step`` is saved, or ``None`` when it is not.

    Args:
        first: this is the first ``maybe_save`` call of the manager.
        votes: every rank's vote (index = rank), each with its :class:`Reading` as ``detail``;
            may be empty for a policy that is not :func:`timed`, or a step that
            ``first_step`` or ``every`` decides alone.
    """
    if first and policy.first_step:
        return "first_step=True"
    if step % policy.every:
        return None
    if not timed(policy):
        return f"step {step} is a multiple of every={policy.every}"
    if any(v.busy for v in votes):
        return None
    agreed: Reading = votes[0].detail  # the coordinator's clock (the module docstring says why)
    if policy.continuous:
        since, least = agreed.since_start_s, policy.min_interval_s or 0.0
        if since is None or since >= least:
            return "continuous: the previous save committed" + (
                "" if since is None else f", {since:.1f} s after it began"
            )
        return None
    interval = policy.interval_s
    if policy.auto:  # what the costs every rank measured give (dcp_safe.manager.goodput)
        interval = choose(agree([v.detail.costs for v in votes])).save_interval_s
    assert interval is not None  # timed and not continuous
    if agreed.since_commit_s >= interval:
        chosen = f" ({interval:.1f} s, auto=True)" if policy.auto else ""
        return f"{agreed.since_commit_s:.1f} s since the last commit >= interval_s{chosen}"
    return None


class Cadence:
    """This rank's side of the schedule: its clock readings, and the vote that decides.

    Args:
        policy: the manager's policy.
        clock: monotonic seconds of this rank (``Runtime.clock``; tests give each rank its own).
        agreement: the manager's exchange of votes.
        slot: the manager's; a save in flight or pending on this rank makes it vote busy.
        ledger, history: the goodput controller's telemetry, and its history (read if ``history``).
    """

    def __init__(
        self,
        policy: SavePolicy,
        clock: Callable[[], float],
        agreement: Agreement,
        slot: SaveSlot | None = None,
        ledger: Ledger | None = None,
        *,
        history: bool = False,
    ) -> None:
        self.policy, self._clock, self._agreement, self._slot = policy, clock, agreement, slot
        self.goodput = Goodput(policy, clock)
        if ledger is not None:
            self.goodput = Goodput.of(policy, clock, ledger, history=history)
        self._committed_at = clock()
        self._started_at: float | None = None
        self._first = True
        self.reason: str | None = None  # why the last step decided was saved (None: it was not)

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved: the same answer on every rank.

        Raises:
            ConfigError: the ranks are at different steps.
            CommitError: a peer died or did not answer within the deadline.
        """
        first, self._first = self._first, False
        votes: list[Vote] = []
        decided_alone = (first and self.policy.first_step) or step % self.policy.every
        if timed(self.policy) and not decided_alone:
            now = self._clock()
            since_start = None if self._started_at is None else now - self._started_at
            busy = self._slot is not None and not self._slot.idle()
            mine = Reading(now - self._committed_at, since_start, self.goodput.vote(now, busy))
            votes = self._agreement.gather(Vote("maybe_save", step, busy=busy, detail=mine))
            require_same_call(votes)
        self.reason = due(self.policy, step, first, votes)
        self.goodput.decided([v.detail.costs for v in votes], saving=self.reason is not None)
        if self.reason is None:
            return False
        self._started_at = self._clock()
        log.debug("maybe_save(%d): saving: %s", step, self.reason)
        return True

    def watch(self, handle: SaveHandle) -> None:
        """A save was requested: its commit restarts the interval; the controller times it."""
        handle.committed.add_done_callback(self.committed)
        self.goodput.watch(handle)

    def committed(self, done: Future[str]) -> None:
        """A save's ``committed`` future resolved: a commit restarts the interval."""
        if not done.cancelled() and done.exception() is None:
            self._committed_at = self._clock()
            self.goodput.committed(self._committed_at, self._started_at)
