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

*The goodput controller* (``auto=True``: Young-Daly) and the expected-work-lost arithmetic.
Saves start every ``T`` s, cost the job ``C`` s each and are durable (on every tier) ``L`` s
after they start; failures come at rate ``1/M`` (``M``: the MTBF), independent of the schedule.

*C*, from the times between the loop's votes (:meth:`Goodput.vote`), so that it is what the job
loses: the *stall* is how much longer the steps from a vote that started a save to the next
vote took than idle ones; the *slowdown*, the fraction of speed lost while a save is in flight;
``C = stall + slowdown · (L - stall)``. Moving averages: the choice follows costs that change.

*Work lost per failure*: the newest durable state is the newest save started at least ``L``
before the failure; a failure at a uniformly random point of the schedule loses work uniform
over ``[L, L + T)``, ``T/2 + L`` on average; per hour ``3600/M · (T/2 + L)``. The restart itself
is the same for every cadence, left out. First order in ``T/M`` (a failure restarts the
schedule): tests/manager/test_goodput.py simulates it and bounds the error.

*The optimum*: the time lost per second, ``C/T + (T/2 + L)/M``, is least at
``T* = sqrt(2·C·M)`` (Young, 1974). Daly's higher-order form (2006) differs by terms in
``sqrt(C/2M)``, under 3 % for ``C/M < 10⁻³``, below the noise of measured costs. ``T*`` is
bounded above by ``M`` (Daly's limit) and :data:`LONGEST_S`, below by ``L``: saves started more
often than the storage makes them durable would queue without end (and the staged copy holds
the host budget until the write ends, before ``L``).

*The MTBF*: ``SavePolicy(mtbf_s=)``, or :func:`estimate_mtbf` from the root's history, with a
Gamma(1, PRIOR_MTBF_S) prior on the rate: ``(PRIOR_MTBF_S + span) / (1 + restarts)``.

The job's costs are the slowest rank's (every collective waits for it), its MTBF the
coordinator's (only it reads the history), agreed in the cadence's vote: one interval on all.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dcp_safe.coordination.agreement import Agreement, Vote, require_same_call
from dcp_safe.manager.slot import SaveSlot

if TYPE_CHECKING:
    from dcp_safe.manager.handles import SaveHandle
    from dcp_safe.manager.ledger import Ledger
    from dcp_safe.manager.options import SavePolicy

log = logging.getLogger("dcp_safe.manager")

#: The prior's MTBF, a small job's: one of thousands of accelerators should give ``mtbf_s``.
PRIOR_MTBF_S = 24 * 3600.0
#: The longest interval ``auto`` chooses: a failure-free history is least reliable there.
LONGEST_S = 6 * 3600.0
_WEIGHT = 0.3  # of the newest measurement in each moving average: costs change, the choice follows


@dataclass(frozen=True)
class Costs:
    """A save's stall, slowdown and time to durable commit (``L``), as the module docstring
    measures them, and the MTBF with where it came from (``None``: not known on this rank)."""

    stall_s: float = 0.0
    slowdown: float = 0.0
    commit_s: float = 0.0
    mtbf_s: float | None = None
    mtbf_note: str = "the prior"

    @property
    def save_s(self) -> float:
        return self.stall_s + self.slowdown * max(0.0, self.commit_s - self.stall_s)


@dataclass(frozen=True)
class Choice:
    """The interval, why, the loss per hour at it, what it came from (as in ManagerStats)."""

    save_interval_s: float | None = None
    interval_reason: str = "no save committed yet"
    expected_loss_per_hour_s: float | None = None
    save_cost_s: float | None = None
    mtbf_s: float | None = None


def agree(costs: Sequence[Costs]) -> Costs:
    """The job's costs from every rank's (index = rank): the slowest rank's, rank 0's MTBF."""
    worst = {f: max(getattr(c, f) for c in costs) for f in ("stall_s", "slowdown", "commit_s")}
    return replace(costs[0], **worst)


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """``sqrt(2·C·M)``: the interval that loses least (the module docstring derives it)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def loss_per_hour_s(interval_s: float, commit_s: float, mtbf_s: float) -> float:
    """Expected seconds of work lost per hour: ``3600/M · (T/2 + L)``."""
    return 3600.0 / mtbf_s * (interval_s / 2.0 + commit_s)


def choose(costs: Costs) -> Choice:
    """``auto``'s interval: Young-Daly's, bounded (the module docstring says by what)."""
    mtbf, c = costs.mtbf_s or PRIOR_MTBF_S, costs.save_s  # None: a cadence without history
    interval = young_daly_s(c, mtbf)
    why = f"auto: sqrt(2 * cost {c:.3g} s * MTBF {mtbf:.4g} s ({costs.mtbf_note}))"
    if interval > (upper := min(mtbf, LONGEST_S)):
        interval, why = upper, f"{why}, capped at {'the MTBF' if upper == mtbf else 'LONGEST_S'}"
    if interval < costs.commit_s:
        interval, why = costs.commit_s, f"{why}, raised to the time to durable commit"
    return Choice(interval, why, loss_per_hour_s(interval, costs.commit_s, mtbf), c, mtbf)


def estimate_mtbf(events: Sequence[Mapping[str, Any]], now: float) -> tuple[float, str]:
    """The MTBF from a root's history events at ``now`` (``time.time()``), and how. A restart:
    a ``rolled_back``, or a ``restored`` from the run's own tiers not after a ``preempted``."""
    times = [e["time"] for e in events if isinstance(e.get("time"), (int, float))]
    span = max(0.0, now - min(times)) if times else 0.0
    restarts = sum(
        e.get("event") == "rolled_back"
        or (e.get("event") == "restored" and e.get("tier") != "initial" and before != "preempted")
        for before, e in zip([None, *(p.get("event") for p in events)], events, strict=False)
    )
    note = f"{restarts} restarts in {span / 3600:.3g} h of history, prior 1 per 24 h"
    return (PRIOR_MTBF_S + span) / (1 + restarts), note


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new


class Goodput:
    """One rank's measurements of what saves cost (``clock``: its monotonic seconds), and the
    interval chosen; ``mtbf``: ``(mtbf_s, note)`` where known. The training thread votes, the
    manager thread reports commits: a lock."""

    def __init__(
        self,
        policy: SavePolicy,
        clock: Callable[[], float],
        mtbf: tuple[float, str] | None = None,
    ) -> None:
        self.policy = policy
        self._clock = clock
        if policy.mtbf_s is not None:
            mtbf = (policy.mtbf_s, "mtbf_s")
        self._costs = Costs() if mtbf is None else Costs(mtbf_s=mtbf[0], mtbf_note=mtbf[1])
        self._lock = threading.Lock()
        # Times between votes: busy (a save in flight), idle, and from one that started a save.
        self._gaps: dict[bool | None, float | None] = {True: None, False: None, None: None}
        self._last_vote: tuple[float, bool | None] | None = None  # None: it started a save
        self._committed_at: float | None = None
        self._between_s: float | None = None  # measured start-to-start (commit-to-commit)
        self._agreed: Choice = Choice()

    def vote(self, now: float, busy: bool) -> Costs:  # times the steps since the last vote
        with self._lock:
            if self._last_vote is not None:
                then, kind = self._last_vote
                if kind is None or kind is busy:  # not a save ending in between
                    self._gaps[kind] = _average(self._gaps[kind], now - then)
            self._last_vote = (now, busy)
            idle, busy_s, saving = (self._gaps[k] for k in (False, True, None))
            # No idle step timed yet (every vote saved so far): the whole gap, or the interval
            # would stay too short to ever time one.
            stall = 0.0 if saving is None else max(0.0, saving - (idle or 0.0))
            slowdown = min(1.0, max(0.0, busy_s / idle - 1)) if busy_s and idle else 0.0
            self._costs = replace(self._costs, stall_s=stall, slowdown=slowdown)
            return self._costs

    def decided(self, costs: Sequence[Costs], saving: bool) -> Choice:  # every rank's costs
        with self._lock:
            if saving and self._last_vote is not None:
                self._last_vote = (self._last_vote[0], None)  # the next gap holds the stall
            if self.policy.auto and costs:
                self._agreed = choose(agree(costs))
            return self._agreed

    def watch(self, handle: SaveHandle) -> None:  # until durable
        if not self.policy.auto:  # other cadences read the clock no more
            return
        start = self._clock()

        def durable(done: Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._commit_took(self._clock() - start)

        handle.replicated.add_done_callback(durable)  # after committed (None without a replica)

    def committed(self, at: float, started_at: float | None) -> None:  # cadence readings
        with self._lock:
            if self._committed_at is not None:
                self._between_s = _average(self._between_s, at - self._committed_at)
            self._committed_at = at
        if not self.policy.auto and started_at is not None and at >= started_at:
            self._commit_took(at - started_at)

    def choice(self) -> Choice:
        """The current interval and expected loss: ``auto``'s as agreed at the last vote; any
        other cadence's from this rank's measurements."""
        with self._lock:
            policy, costs = self.policy, self._costs
            if policy.auto:
                return self._agreed
            interval, why = policy.interval_s, "interval_s"
            if interval is None:
                cadence = "continuous=True" if policy.continuous else f"every={policy.every}"
                interval, why = self._between_s, f"measured between commits ({cadence})"
            if interval is None or costs.mtbf_s is None:
                return Choice() if interval is None else Choice(interval, why)
            loss = loss_per_hour_s(interval, costs.commit_s, costs.mtbf_s)
            return Choice(interval, why, loss, mtbf_s=costs.mtbf_s)

    def _commit_took(self, seconds: float) -> None:
        with self._lock:
            took = _average(self._costs.commit_s or None, seconds)
            self._costs = replace(self._costs, commit_s=took)


@dataclass(frozen=True)
class Reading:
    """One rank's clock at a vote, in seconds, and what a save costs as this rank measured it."""

    since_commit_s: float  # since the last save committed (or the manager was built)
    since_start_s: float | None = None  # since the last save this cadence started
    costs: Costs = field(default_factory=Costs)


def timed(policy: SavePolicy) -> bool:  # needs the ranks' clocks: a vote per step that could save
    return policy.interval_s is not None or policy.continuous or policy.auto


def due(policy: SavePolicy, step: int, first: bool, votes: Sequence[Vote]) -> str | None:
    """Why ``step`` is saved, or ``None`` when it is not (``first``: the manager's first
    ``maybe_save``). ``votes``: every rank's, each with its :class:`Reading` as ``detail``;
    empty where the policy is not :func:`timed` or ``first_step`` or ``every`` decide alone."""
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
    if policy.auto:  # what the costs every rank measured give (the module docstring)
        interval = choose(agree([v.detail.costs for v in votes])).save_interval_s
    assert interval is not None  # timed and not continuous
    if agreed.since_commit_s >= interval:
        chosen = f" ({interval:.1f} s, auto=True)" if policy.auto else ""
        return f"{agreed.since_commit_s:.1f} s since the last commit >= interval_s{chosen}"
    return None


class Cadence:
    """This rank's side of the schedule: its clock readings (``clock``: ``Runtime.clock``), and
    the vote that decides. A save in flight or pending in ``slot`` makes it vote busy; ``ledger``
    gives the goodput controller its telemetry, and its history where ``history``."""

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
        self.policy = policy
        self._clock = clock
        self._agreement = agreement
        self._slot = slot
        self._ledger = ledger
        # A manager's: the MTBF from the history where ``history`` (the coordinator) and not
        # given; each commit's choice marked ``save_interval`` (a failure there only counted).
        mtbf = None
        if ledger is not None and history and policy.mtbf_s is None:  # unreadable: the prior
            events: list[Any] = []
            ledger.quietly("reading the history", lambda: events.extend(ledger.history.read()))
            mtbf = estimate_mtbf(events, time.time())
        self.goodput = Goodput(policy, clock, mtbf)
        self._committed_at = clock()
        self._started_at: float | None = None
        self._first = True

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved: the same answer on every rank (``ConfigError``: the ranks
        are at different steps; ``CommitError``: a peer died or did not answer in time)."""
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
        reason = due(self.policy, step, first, votes)
        self.goodput.decided([v.detail.costs for v in votes], saving=reason is not None)
        if reason is None:
            return False
        self._started_at = self._clock()
        log.debug("maybe_save(%d): saving: %s", step, reason)
        return True

    def watch(self, handle: SaveHandle) -> None:  # its commit restarts the interval
        handle.committed.add_done_callback(self.committed)
        self.goodput.watch(handle)

    def committed(self, done: Future[str]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._committed_at = self._clock()
            self.goodput.committed(self._committed_at, self._started_at)
            if self._ledger is not None and (telemetry := self._ledger.telemetry) is not None:
                choice = vars(self.goodput.choice())
                mark = functools.partial(telemetry.mark, "save_interval", **choice)
                self._ledger.quietly("telemetry", mark)
