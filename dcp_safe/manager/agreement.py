"""Every rank decides the same: one small exchange per save request, then a pure decision.

Under ``torchrun`` each rank has its own :class:`~dcp_safe.manager.CheckpointManager`, and each
sees only its own state: whether its last save is still in flight, its own host memory, its own
fallback monitor. Left to themselves they disagree (rank 0 still pruning after the commit while
rank 1 is idle), and a rank that skips a save its peers take part in leaves them waiting in
DCP's collectives. So before acting on a request each rank states what it sees as a
:class:`Vote`, every rank receives every vote (one ``all_gather_object`` on a dcp_safe-owned
gloo group, whose timeout is the manager's deadline), and :func:`decide` turns the same list of
votes into the same :class:`Decision` everywhere. The rules, in order:

1. ranks that ask for different steps (or are in different calls) -> every rank raises
   :class:`~dcp_safe.errors.ConfigError`: the loops have diverged;
2. any rank's automatic fallback tripped -> every rank saves synchronously;
3. any rank's save in flight is older than the latency objective -> every rank skips (or
   raises, under ``when_busy="raise"``): the storage is stuck, queueing more cannot help;
4. no rank busy -> every rank starts the save;
5. some rank busy -> every rank applies ``when_busy`` (``coalesce`` skips if any rank has no
   memory for the pending copy; ``wait`` waits locally, bounded, then votes again: any rank
   still busy -> every rank skips).

The exchange runs on the training thread, in ``save``; a peer that died or hung fails it after
the deadline with a :class:`~dcp_safe.errors.CommitError`, and the manager stays failed (a gloo
group with a dead member cannot be used again). In a single process there is no exchange: the
list of votes is this process's own.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch.distributed as dist

from dcp_safe.dcp.group import checkpoint_group, collective_failure, is_collective_failure
from dcp_safe.errors import CommitError, ConfigError, DcpSafeError
from dcp_safe.manager.handles import BusyPolicy

__all__ = ["Agreement", "Decision", "Verdict", "Vote", "decide", "require_same_call"]

T = TypeVar("T")


@dataclass(frozen=True)
class Vote:
    """What one rank sees when a request arrives.

    Attributes:
        call: which manager call is voting (``"save"``, ``"wait"``, ``"preempt"``...).
        step: the step requested (``-1`` when the call has none).
        busy: a save is in flight or pending on this rank.
        fallback: why this rank's automatic fallback tripped (``None``: it did not).
        no_room: no memory for a coalesced pending copy on this rank.
        stalled: why the save in flight is over its latency objective (``None``: it is not).
        detail: anything else the call exchanges (a preemption's plan, a restore's name).
    """

    call: str
    step: int
    busy: bool = False
    fallback: str | None = None
    no_room: bool = False
    stalled: str | None = None
    detail: Any = None


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
    """The verdict, why, and the agreed fallback reason (naming the ranks that tripped)."""

    verdict: Verdict
    reason: str = ""
    fallback: str | None = None


def decide(votes: Sequence[Vote], policy: BusyPolicy) -> Decision:
    """The decision every rank takes for one request, from every rank's vote (index = rank).

    Raises:
        ConfigError: the ranks are in different calls or ask for different steps.
    """
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
        short = [r for r, v in enumerate(votes) if v.no_room]
        if short:
            return Decision(
                Verdict.SKIP, f"coalesce: no memory for a pending copy on {_ranks(short)}"
            )
        return Decision(Verdict.COALESCE, f"a save is in flight on {who}")
    verdict = {
        BusyPolicy.WAIT: Verdict.WAIT,
        BusyPolicy.SKIP: Verdict.SKIP,
        BusyPolicy.RAISE: Verdict.RAISE,
        BusyPolicy.SYNC: Verdict.SYNC,
    }[policy]
    return Decision(verdict, f"busy: a save is in flight on {who} (when_busy={policy.value!r})")


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


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Agreement:
    """The exchange of votes: over a gloo group, or within one process.

    Args:
        group: the policy group (``None``: a single process, nothing is exchanged).
        deadline_s: the group's timeout, for error messages.
    """

    def __init__(self, group: Any = None, deadline_s: float | None = None) -> None:
        self.group = group
        self.deadline_s = deadline_s
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self._failed: CommitError | None = None

    @classmethod
    def for_job(cls, deadline_s: float) -> Agreement:
        """Over its own group when ``torch.distributed`` is initialized, else within one process.

        Creating the group is a collective: every rank must construct its manager at the same
        point in its program.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        return cls(checkpoint_group(deadline_s, purpose="manager-policy"), deadline_s)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def coordinator(self) -> bool:
        """This rank writes the shared state (history, retention, sweeping)."""
        return self.rank == 0

    def gather(self, vote: Vote) -> list[Vote]:
        """Every rank's vote, in rank order (only this one's in a single process).

        Raises:
            CommitError: a peer died or did not answer within the deadline (and every later
                exchange raises it again at once: the group is unusable).
        """
        if self.group is None:
            return [vote]
        return list(self._exchange(lambda out: dist.all_gather_object(out, vote, self.group)))

    def broadcast(self, value: object) -> Any:
        """The coordinator's ``value`` on every rank (``value`` is ignored elsewhere).

        Raises:
            CommitError: as for :meth:`gather`.
        """
        if self.group is None:
            return value
        box = [value if self.coordinator else None]
        src = dist.get_global_rank(self.group, 0)
        self._exchange(lambda _: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def settle(self, call: str, step: int, work: Callable[[], T]) -> T:
        """Run ``work`` on the coordinator only; its result, or its error, on every rank.

        For what must be decided once from shared storage (which checkpoint ``latest`` is), so
        that a concurrent commit or prune cannot make two ranks see different answers.

        Raises:
            BaseException: what ``work`` raised on the coordinator (unpicklable errors travel
                as :class:`DcpSafeError` with their text).
            ConfigError: the ranks are in different calls.
            CommitError: as for :meth:`gather`.
        """
        if self.group is None:
            return work()
        outcome: tuple[str, Any] | None = None
        failed: Exception | None = None
        if self.coordinator:
            try:
                outcome = ("ok", work())
            except Exception as exc:
                failed, outcome = exc, ("error", _portable(exc))
        votes = self.gather(Vote(call, step, detail=outcome))
        require_same_call(votes)
        kind, value = votes[0].detail
        if failed is not None:
            raise failed
        if kind == "error":
            raise _restored(value, 0)
        return cast(T, value)

    def _exchange(self, run: Any) -> list[Any]:
        if self._failed is not None:
            raise self._failed
        out: list[Any] = [None] * self.world_size
        try:
            run(out)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self._failed = collective_failure(
                exc, rank=self.rank, world_size=self.world_size, deadline_s=self.deadline_s
            )
            raise self._failed from exc
        return out


def _portable(error: BaseException) -> str:
    try:
        return pickle.dumps(error).hex()
    except Exception:
        return pickle.dumps(DcpSafeError(f"{type(error).__name__}: {error}")).hex()


def _restored(blob: str, rank: int) -> BaseException:
    try:
        error = pickle.loads(bytes.fromhex(blob))  # from a peer of this job, not from storage
    except Exception:
        error = None
    if isinstance(error, BaseException):
        return error
    return DcpSafeError(f"rank {rank} failed (its error could not be passed on)")
