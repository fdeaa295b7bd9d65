"""The manager's exchange of votes: one small all-gather per request on the policy group.

Every rank then takes the same decision from the same votes (:mod:`dcp_safe.manager.saving`).
The rounds of a wait and the replacement of broken groups are described in docs/multirank.md
("The manager under torchrun", "When one rank is slow", "A broken group is replaced, never
reused"). The exchange runs on the training thread; in a single process there is none: the list
of votes is this process's own.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from dcp_safe.coordination.group import broadcast_object, gather_objects, typed_failures
from dcp_safe.coordination.groups import POLICY, ManagerGroups
from dcp_safe.errors import CommitError, ConfigError, DcpSafeError, describe, portable, restored
from dcp_safe.torch_compat import rank_world

T = TypeVar("T")


@dataclass(frozen=True)
class Vote:
    """What one rank sees when a request arrives."""

    call: str  # which manager call is voting ("save", "wait", "preempt"...)
    step: int  # -1 when the call has none
    busy: bool = False  # a save is in flight or pending on this rank
    fallback: str | None = None  # why this rank's automatic fallback tripped
    no_room: bool = False  # no memory for a coalesced pending copy on this rank
    stalled: str | None = None  # why the save in flight is over its latency objective
    detail: Any = None  # anything else the call exchanges (a preemption's plan, a restore's name)
    pending: int | None = None  # the step of the coalesced save parked here, not started yet
    broken: tuple[str, ...] = ()  # the save groups this rank saw fail since its last vote
    expired: bool = False  # in a round of waiting, this rank's wait passed its bound
    worker_ready: bool = False  # this rank's checkpoint worker is ready (executor="process")


def groups_to_replace(votes: Sequence[Vote]) -> tuple[str, ...]:
    """The save groups any rank saw fail: every rank replaces these after the exchange."""
    return tuple(sorted({purpose for v in votes for purpose in v.broken}))


def require_same_call(votes: Sequence[Vote]) -> None:
    """Raise unless every rank is in the same call for the same step.

    Raises:
        ConfigError: naming the ranks that differ from rank 0.
    """
    first = votes[0]
    odd = [r for r, v in enumerate(votes) if (v.call, v.step) != (first.call, first.step)]
    if odd:
        seen = ", ".join(f"rank {r}: {votes[r].call}(step {votes[r].step})" for r in odd)
        raise ConfigError(
            f"the ranks' checkpoint calls diverged (rank 0: {first.call}(step {first.step});"
            f" {seen}); every rank must call the manager's save/maybe_save/restore/close with"
            " the same steps in the same order"
        )


class Agreement:
    """The exchange of votes: over the manager's policy ``groups``, or within one process
    (``None``: nothing is exchanged)."""

    def __init__(self, groups: ManagerGroups | None = None) -> None:
        self.groups = groups
        self.distributed = groups is not None
        self.rank = 0 if groups is None else groups.rank
        self.coordinator = self.rank == 0  # this rank writes the shared state (history, sweeping)
        self.world_size = 1 if groups is None else groups.world_size
        # Well inside the deadline: a rank that waited a whole round is still in time to vote.
        self.round_s = math.inf if groups is None else groups.deadline_s / 4
        self.token = str(self.broadcast(uuid.uuid4().hex))  # the coordinator's, on every rank

    @classmethod
    def for_job(cls, deadline_s: float) -> Agreement:
        """Over its own groups when ``torch.distributed`` is initialized, else within one process.

        Creating the groups is a collective: every rank must construct its manager at the same
        point in its program.
        """
        if rank_world()[1] == 1:
            return cls()
        return cls(ManagerGroups(deadline_s))

    def release(self) -> None:
        if self.groups is not None:
            self.groups.release()

    def gather(self, vote: Vote) -> list[Vote]:
        """Every rank's vote, in rank order (only this one's in a single process).

        Raises:
            CommitError: a peer died or did not answer within the deadline, or a broken save
                group could not be replaced (also from :meth:`broadcast` and the waits).
        """
        if self.groups is None:
            return [vote]
        mine = dataclasses.replace(vote, broken=self.groups.broken())
        votes: list[Vote] = self._exchange(lambda group: gather_objects(mine, group))
        self.groups.replace(groups_to_replace(votes))  # none: nothing to replace
        return votes

    def broadcast(self, value: object) -> Any:
        """The coordinator's ``value`` on every rank (``value`` is ignored elsewhere)."""
        if self.groups is None:
            return value
        mine = value if self.coordinator else None
        return self._exchange(lambda group: broadcast_object(mine, group))

    def until_all(
        self, call: str, step: int, ready: Callable[[float], bool], timeout_s: float
    ) -> list[int]:
        """Wait, in rounds, until every rank is ready or one rank's wait passed ``timeout_s``.

        Each round every rank calls ``ready(wait_s)`` (wait at most ``wait_s`` for its own
        work; ``True`` once it is done), then votes; every rank leaves at the same round, with
        the ranks still not ready (empty: every rank is). ConfigError: the ranks are in
        different calls.
        """
        started = time.monotonic()
        while True:
            left = timeout_s - (time.monotonic() - started)
            last = left <= self.round_s  # this round may use up what is left of the bound
            done = ready(max(0.0, min(self.round_s, left)))
            expired = not done and last
            votes = self.gather(Vote(call, step, busy=not done, expired=expired))
            require_same_call(votes)
            still = [r for r, v in enumerate(votes) if v.busy]
            if not still or any(v.expired for v in votes):
                return still

    def settle(self, call: str, step: int, work: Callable[[], T], timeout_s: float) -> T:
        """Run ``work`` on the coordinator only; its result, or its error, on every rank.

        For what must be decided once from shared storage (which checkpoint ``latest`` is);
        the peers wait in rounds, so a slow listing is not taken for a dead coordinator.

        Raises:
            BaseException: what ``work`` raised, on the coordinator; on the peers an
                ``Exception`` as it is, anything else (or an unpicklable error) as a
                :class:`CommitError` naming rank 0 with its text.
            CommitError: ``work`` took longer than ``timeout_s``.
        """
        if self.groups is None:
            return work()
        outcome: list[tuple[str, Any]] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(("ok", work()))
            except BaseException as exc:
                failed.append(exc)  # raised on the coordinator, after the peers learn of it
                stopped = CommitError(
                    f"{call}: the coordinator failed with {describe(exc)}", {0: describe(exc)}
                )
                # The peers were not interrupted nor asked to exit: only an Exception travels.
                sent = exc if isinstance(exc, Exception) else stopped
                outcome.append(("error", portable(sent, stopped)))

        worker = threading.Thread(target=run, name=f"dcp_safe-{call}", daemon=True)
        if self.coordinator:
            worker.start()

        def ready(wait_s: float) -> bool:
            if not self.coordinator:
                return True
            worker.join(wait_s)
            return not worker.is_alive()

        if self.until_all(call, step, ready, timeout_s):
            raise CommitError(
                f"{call}: the coordinator took longer than {timeout_s:g} s",
                {0: f"{call} was still running"},
            )
        votes = self.gather(Vote(call, step, detail=outcome[0] if outcome else None))
        require_same_call(votes)
        kind, value = votes[0].detail
        if failed:
            raise failed[0]
        if kind == "error":
            # From a peer of this job, not from storage.
            raise restored(
                value, lambda _: DcpSafeError("rank 0 failed (its error could not be passed on)")
            )
        return cast(T, value)

    def _exchange(self, run: Callable[[Any], T]) -> T:
        groups = self.groups
        assert groups is not None
        group = groups.group(POLICY)
        with typed_failures(
            group,
            deadline_s=groups.deadline_s,
            operation="vote",
            forget=lambda exc: groups.saw_failure(POLICY, exc, group),
        ):
            return run(group)
