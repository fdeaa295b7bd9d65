"""How an admitted save runs (in the background, in the foreground, or coalesced) and what
follows its local commit: verify it, record it, replicate it, then let retention prune.

Background and foreground saves use two different groups (:mod:`~dcp_safe.coordination.groups`): a
communicator carries one ordered stream of collectives, and a foreground save may run while a
background one is still in its collectives. A save whose group broke marks it broken; the next
vote replaces it on every rank.

The follow-up runs on the manager thread (asynchronous saves) or the caller's (synchronous
ones). A checkpoint that fails verification is not trusted: no replication, no pruning behind
it, the save fails. A retention failure does not fail the save; it is kept for ``wait``/
``close``. ``committed`` resolves last, ``replicated`` once the replica's outcome is recorded.

*Admission* of one save request: the decision every rank takes from every rank's vote.
:class:`SaveRunner` casts this rank's vote, waits and starts the save.

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

import contextlib
import dataclasses
import enum
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from dcp_safe.adapters import api
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.coordination.agreement import Agreement, Vote, require_same_call
from dcp_safe.coordination.groups import BACKGROUND, FOREGROUND, WORKERS
from dcp_safe.coordination.store import PromotionBarrier, Verdicts
from dcp_safe.errors import (
    DcpSafeError,
    DrainTimeoutError,
    ReplicationSkippedError,
    SnapshotMutatedError,
    _per_rank,
    _ranks,
)
from dcp_safe.manager.fallback import FallbackSwitch
from dcp_safe.manager.handles import BusyPolicy, Pending, SaveHandle, StagingMode, settle
from dcp_safe.manager.in_memory import InMemoryTier
from dcp_safe.manager.ledger import Ledger
from dcp_safe.manager.options import Bounds, SavePolicy
from dcp_safe.manager.slot import SaveSlot
from dcp_safe.manager.tiers import Tiers
from dcp_safe.staging import BudgetedStager
from dcp_safe.staging._tree import collect_tensors, state_dicts_of
from dcp_safe.staging.guard import snapshot_copy
from dcp_safe.worker.parent import SaveWorker
from dcp_safe.worker.transport import check_commit, decode_error

log = logging.getLogger("dcp_safe.manager")


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
    tripped = {r: v.fallback for r, v in enumerate(votes) if v.fallback is not None}
    if tripped:
        reason = _per_rank(tripped, "; ")
        return Decision(Verdict.SYNC, reason, fallback=reason)
    stalled = {r: v.stalled for r, v in enumerate(votes) if v.stalled is not None}
    if stalled:
        reason = _per_rank(stalled, "; ")
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


@dataclass(kw_only=True, eq=False)
class SaveRunner:
    """Admits saves (as above), runs them over the manager's parts, follows their commits up.

    ``deep``: this rank checks every byte of a new checkpoint (the coordinator's job with
    ``validate="deep"``). ``verdicts``, ``barrier``: ``None`` in a single process.
    ``worker`` runs background saves in a worker process once every rank's is ready (a save's
    agreed ``worker`` flag); until then, and without one, they run on DCP's upload thread.
    """

    writer: SafeStorageWriter
    stager: BudgetedStager
    slot: SaveSlot
    ledger: Ledger
    tiers: Tiers
    switch: FallbackSwitch
    deep: bool
    per_rank: tuple[str, ...]
    in_memory: InMemoryTier | None  # keep_in_memory=True
    worker: SaveWorker | None
    agreement: Agreement
    policy: SavePolicy
    bounds: Bounds
    verdicts: Verdicts | None = field(init=False)
    barrier: PromotionBarrier | None = field(init=False)
    # The agreed coalesce decisions so far: a pending save's ``seq``.
    _coalesced: int = field(default=0, init=False)
    sync_writer: SafeStorageWriter | None = field(default=None, init=False)
    _last_staged: Future[None] | None = field(default=None, init=False)
    post: ThreadPoolExecutor = field(init=False)  # the manager thread

    def __post_init__(self) -> None:
        wait_s = self.bounds.wait_timeout_s
        self.verdicts = Verdicts.for_job(self.agreement, wait_s)
        self.barrier = PromotionBarrier.for_job(self.agreement, wait_s)
        self.post = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-manager")

    def admit(
        self, handle: SaveHandle, policy: BusyPolicy, state_dict: dict[str, Any], *, force: bool
    ) -> Decision:
        """The decision for ``handle``; ``START`` means the slot is free now on every rank.
        ``WAIT`` the caller resolves with :meth:`wait`, outside the slot's freeze."""
        fallback = self.switch.on_request(handle, self._leaked_bytes)
        busy = not self.slot.idle()
        vote = Vote(
            "save",
            handle.step,
            busy=busy,
            fallback=fallback,
            no_room=busy and policy is BusyPolicy.COALESCE and self._no_room(state_dict),
            stalled=None if force else self.slot.stalled(self.policy.latency_objective_s),
            pending=self.slot.pending_step(),
            worker_ready=self.worker is not None and self.worker.ready,
        )
        decision = decide(self.agreement.gather(vote), policy)
        if self.worker is not None and not decision.worker:
            self.worker.start()
        self.switch.follow(handle, decision.fallback)
        return decision

    def wait(self, handle: SaveHandle, *, force: bool, worker: bool = False) -> Decision:
        """Wait with every rank until no rank has a save in flight, or ``wait_timeout_s``
        (``worker``: the request's agreed path, kept for the start)."""
        wait_s = self.bounds.wait_timeout_s
        still = self.agreement.until_all("wait", handle.step, self.slot.wait_free, wait_s)
        if not still:
            return Decision(Verdict.START, worker=worker)
        self.ledger.count("waits_expired")
        reason = (
            f"waited {wait_s:g} s (wait_timeout_s) and a save was still in flight on rank(s)"
            f" {', '.join(map(str, still))}"
        )
        return Decision(Verdict.RAISE if force else Verdict.SKIP, reason)

    def _leaked_bytes(self) -> int:  # the fallback's trigger c
        # Idle first, stats second: only the training thread starts saves, so once idle, what
        # the stager still has in use was leaked by a finished save, not leased by a new one.
        if not self.slot.idle():
            return 0
        stats = self.stager.stats()
        return stats.in_use_bytes - stats.kept_bytes  # keep_in_memory's copy is no leak

    def _no_room(self, state_dict: dict[str, Any]) -> bool:
        pending = self.slot.pending  # the copy it replaces is alive while this one is taken
        held = pending.nbytes if pending is not None else 0
        room = self.stager.budget.envelope_bytes - self.stager.stats().pool_bytes - held
        return _nbytes(state_dict) > room

    @contextlib.contextmanager
    def collectives(self, purpose: str) -> Iterator[dict[str, Any]]:
        """DCP's keyword arguments for a save or load on ``purpose``'s group; a failure inside
        that broke the group marks it (:meth:`saw_failure`)."""
        groups = self.agreement.groups
        kwargs = {"no_dist": True} if groups is None else groups.collectives(purpose)
        try:
            yield kwargs
        except BaseException as exc:
            self.saw_failure(purpose, exc, kwargs.get("process_group"))
            raise

    def start(self, handle: SaveHandle, state_dict: dict[str, Any], worker: bool = False) -> None:
        """Start the async save of ``handle`` (its slot is held), in the worker if the ranks
        agreed on it (``worker``); on refusal free the slot."""
        try:
            self._launch(handle, state_dict, worker)
        except BaseException as exc:
            self.ledger.fail(handle, exc, tier="local", keep=False)
            self._finish_slot()
            raise

    def _launch(self, handle: SaveHandle, state_dict: dict[str, Any], worker: bool) -> None:
        if self.in_memory is not None:
            self.in_memory.check_room(state_dict)
        keep = None if self.in_memory is None else handle  # kept once its upload succeeded
        if worker and self.worker is not None:
            with self.ledger.opened(handle):  # as dcp.async_save: a model by its state dict
                staged = self.stager.stage(state_dicts_of(state_dict))
            upload = self.worker.submit(handle.name, handle.step, staged, handle.metrics)
            self.stager.track(upload, keep=keep)
            self.ledger.count("worker_saves")
            self._started(handle, staged, upload, None, self.worker)
            return
        writer = self.writer.for_step(handle.step, handle.metrics)
        with self.collectives(BACKGROUND) as collectives, self.ledger.opened(handle):
            response = api.async_save(
                state_dict,
                checkpoint_id=handle.name,
                storage_writer=self.ledger.wrap(writer),
                async_stager=self.stager,
                per_rank=self.per_rank,
                **collectives,
            )
        self.stager.track(response, keep=keep)
        group = collectives.get("process_group")
        self._started(handle, response.staging_completion, response.upload_completion, group)

    def _started(
        self,
        handle: SaveHandle,
        staged: Future[Any],
        upload: Future[Any],
        group: Any,
        worker: SaveWorker | None = None,
    ) -> None:
        """Follow a started save (``worker``: the one running it): its copy, then its upload."""
        staged.add_done_callback(lambda done: _copied(done, handle.staged))
        with self.ledger.cond:
            self._last_staged = handle.staged

        def follow(done: Future[Any]) -> None:  # here if a close that gave up stopped the thread
            try:
                self.post.submit(self._after_upload, handle, done, group, worker)
            except RuntimeError:
                self._after_upload(handle, done, group, worker)

        upload.add_done_callback(follow)
        if self.policy.staging is StagingMode.SNAPSHOT:
            # The copy is bounded and budgeted; its failure (a torn snapshot from another
            # thread) reaches the handle's futures and the history, not this call.
            wait_futures([handle.staged], timeout=self.stager.options.timeout_s)

    def wait_staged(self, timeout_s: float | None) -> None:
        with self.ledger.cond:
            staged = self._last_staged
        if staged is not None and wait_futures([staged], timeout=timeout_s).not_done:
            raise DrainTimeoutError(f"the state was still being copied after {timeout_s} s")

    def foreground(self, handle: SaveHandle, state_dict: dict[str, Any]) -> None:
        """Save ``handle`` now, synchronously, on the writer's twin (its uploads are its own,
        since an asynchronous save may be running on the writer), then follow its commit up."""
        if self.sync_writer is None:
            self.sync_writer = self.writer.detached()
        writer = self.sync_writer.for_step(handle.step, handle.metrics)
        self.ledger.count("sync_saves")
        try:
            with self.collectives(FOREGROUND) as collectives, self.ledger.opened(handle):
                api.save(
                    state_dict,
                    checkpoint_id=handle.name,
                    storage_writer=self.ledger.wrap(writer),
                    per_rank=self.per_rank,
                    **collectives,
                )
        except BaseException as exc:
            self.ledger.fail(handle, exc, tier="local", keep=False)
            raise
        handle.staged.set_result(None)
        self.after_commit(handle, writer)

    def coalesce(
        self, handle: SaveHandle, state_dict: dict[str, Any], worker: bool = False
    ) -> SaveHandle | None:
        """Copy the state now and make it the pending save (started at once if the slot is
        free meanwhile; in the worker if ``worker``). For an agreed ``COALESCE`` decision, on
        every rank, with the slot frozen (the admission checked the budget has room)."""
        self._coalesced += 1  # counted before the copy can fail: the same on every rank
        try:  # another thread may update the state while it is copied
            state = snapshot_copy(state_dict)
        except SnapshotMutatedError as exc:
            self.ledger.fail(handle, exc, tier="local")
            if self.barrier is not None:  # the peers' copy of this pending save starts nowhere
                self.barrier.abandon(self._coalesced)
            return handle
        handle.staged.set_result(None)
        pending = Pending(handle, state, _nbytes(state), seq=self._coalesced, worker=worker)
        replaced, start_now = self.slot.park(pending)
        self.ledger.count("coalesced")
        if replaced is not None:
            replaced.handle.cancel()
            reason = f"coalesced into step {handle.step}"
            self.ledger.skip(replaced.handle, reason, mark="coalesced")
        if start_now:  # the save in flight finished meanwhile (or none was, on this rank)
            self.ledger.count("started")
            if self.barrier is None:
                self.start(handle, state, worker)
            else:  # the peers may still be busy: meet them at the barrier, off this thread
                self.post.submit(self._finish_slot, pending)
        return handle

    def drop_pending(self) -> Pending | None:
        """Take the pending save out, never to start it (its barrier is abandoned)."""
        pending = self.slot.drop_pending()
        if pending is not None and self.barrier is not None:
            self.barrier.abandon(pending.seq)
        return pending

    def _after_upload(
        self, handle: SaveHandle, upload: Future[Any], group: Any, worker: SaveWorker | None
    ) -> None:
        """On the manager thread: fail the handle or follow its commit up, then free the slot.

        ``worker``: the process executor's, which replicated and checked the save (its futures
        and check are taken from it rather than from the writer and :class:`Tiers`)."""
        try:
            error = upload.exception()
            self.saw_failure(BACKGROUND, error, group)
            self.after_commit(handle, self.writer, error, worker)
        except BaseException as exc:  # a bug here must not leave the handle unresolved
            self.ledger.fail(handle, exc, tier="local")
        finally:
            self._finish_slot()

    def _finish_slot(self, pending: Pending | None = None) -> None:
        """Start ``pending`` (it holds the slot already); with none, or once it is out of the
        way, free the slot or hand it to the next pending coalesced save, and start that.

        A start that fails fails the pending save's handle and is kept for ``wait``/``close``;
        one the ranks' barrier abandoned is skipped, on every rank alike."""
        while pending is not None or (pending := self._release()) is not None:
            try:
                dropped = None
                if self.barrier is not None:
                    dropped = self.barrier.cross(pending.seq, pending.handle.step)
                if dropped is None:
                    self._launch(pending.handle, pending.state, pending.worker)
                    return
                pending.handle.cancel()  # as a replaced pending save is
                self.ledger.skip(pending.handle, dropped, mark="coalesced")
            except BaseException as exc:
                self.ledger.fail(pending.handle, exc, tier="local")
            pending = None

    def _release(self) -> Pending | None:
        if (pending := self.slot.release()) is not None:
            self.ledger.count("started")
        return pending

    def saw_failure(self, purpose: str, error: BaseException | None, group: Any) -> None:
        groups = self.agreement.groups
        if groups is not None and groups.saw_failure(purpose, error, group):
            self.ledger.count("groups_broken")

    def after_commit(
        self,
        handle: SaveHandle,
        writer: SafeStorageWriter,
        error: BaseException | None = None,
        worker: SaveWorker | None = None,
    ) -> None:
        """``handle`` committed locally through ``writer`` (or failed with ``error``, which in a
        multi-rank job the coordinator's verdict may overrule: see :mod:`.verdicts`)."""
        failure = (error, None) if error is not None else self._check(handle, writer, worker)
        if self.verdicts is not None:
            key = self.verdicts.key_for(handle.name)
            if self.verdicts.coordinator:
                lost = self.verdicts.post(key, failure and failure[0])
                if failure is None and lost is not None:  # a peer gave up waiting first
                    failure = (lost, self._withdraw(handle, lost))
            else:  # the coordinator's verdict decides; this rank's own error says it best
                verdict = self.verdicts.await_verdict(key)
                if verdict is None:
                    failure = None
                elif failure is None:
                    failure = (verdict, str(verdict))
        if failure is not None:
            # Neither pruning nor a replication future: the newest checkpoint is not trusted.
            self.ledger.fail(handle, failure[0], tier="local", reason=failure[1])
            return
        self.ledger.count("committed")
        if (peers := self.tiers.peers) is not None:  # every rank, in the same order of saves
            self.tiers.track_replication(handle.name, peers.copy(handle.name, self._peer_copied))
        self.ledger.record(
            "committed", handle, tier="local", validated=True, metrics=handle.metrics
        )
        if (tier := self.in_memory) is not None:  # before ``committed``: a rollback may follow
            self.ledger.quietly("in-memory tier", lambda: tier.committed(handle))
        # On a thread while the worker starts: not counted by the fallback (a start-up).
        self.switch.on_committed(handle, counted=worker is not None or self.worker is None)
        if writer.topology.replica is None:  # a node-local save is uploaded before it counts
            handle.replicated.set_result(None)
        else:
            remote = (worker or writer).replication(handle.name)
            self.tiers.track_replication(handle.name, handle.replicated)
            remote.add_done_callback(lambda done: self._replicated(handle, done))
        try:
            self.tiers.prune()
        except (DcpSafeError, OSError) as exc:  # the save itself succeeded: keep, do not fail it
            log.warning("retention after %s failed: %s", handle.name, exc)
            self.ledger.keep(exc)
        # A caller that reads the history once ``committed`` resolves finds the event there.
        self.ledger.flush(self.bounds.deadline_s)
        with contextlib.suppress(InvalidStateError):  # resolved by a close that gave up on it
            handle.committed.set_result(handle.name)
        self.ledger.quietly("telemetry", lambda: self.ledger.end_span(handle, None))

    def _withdraw(self, handle: SaveHandle, lost: BaseException, tier: str = "local") -> str:
        """The coordinator's verdict lost to a peer that gave up waiting (every rank records the
        save failed): retire the checkpoint it committed, so that no checkpoint is listed
        without its ``committed`` event. Why, for the ``failed`` event."""
        reason = f"committed, but {lost}: withdrawn"
        try:
            self.tiers.withdraw(handle.name, tier)
        except (DcpSafeError, OSError) as exc:  # still listed: kept for wait/close to raise
            log.warning("withdrawing %s failed: %s", handle.name, exc)
            self.ledger.keep(exc)
            reason = f"committed, but {lost}; withdrawing it failed: {exc}"
        return reason[:500]

    def _check(
        self,
        handle: SaveHandle,
        writer: SafeStorageWriter,
        worker: SaveWorker | None = None,
    ) -> tuple[BaseException, str] | None:
        """Wait for the commit (node-local) and check the checkpoint; why it is not trusted."""
        try:
            if writer.topology.node_cache is not None:  # committed once uploaded: wait
                # The writer's own waits end first (twice remote_timeout_s); this backs them up.
                options = getattr(writer, "node_options", writer.replication_options)
                wait_s = 2 * float(options.remote_timeout_s) + 60.0
                (worker or writer).replication(handle.name).result(timeout=wait_s)
        except (DcpSafeError, OSError) as exc:
            return exc, f"remote commit failed: {exc}"
        try:
            checked = None if worker is None else worker.checked(handle.name)
            if checked is None:
                check_commit(self.writer, handle.name, deep=self.deep)
            elif checked.error is not None:
                raise decode_error(checked.error)
            self.tiers.trust(handle.name)
        except (DcpSafeError, OSError) as exc:
            return exc, f"verification failed: {exc}"
        return None

    def _peer_copied(self, name: str, error: BaseException | None) -> None:
        """The peer copies of ``name`` ended: counted; a failure is kept for ``wait``/``close``
        to raise, never failing the committed save."""
        if error is not None:
            log.warning("peer copies of %s failed: %s", name, error)
            self.ledger.keep(error)
        self.ledger.count("peer_copies" if error is None else "peer_copy_failures")

    def _replicated(self, handle: SaveHandle, done: Future[Any]) -> None:
        if handle.replicated.done():
            return
        if self.verdicts is None:
            self._record_replication(handle, done, done.exception())
            return
        # Several ranks: rank 0's remote outcome decides, as its local one does. On a thread of
        # its own: a rank waits up to wait_timeout_s for it, and this is an upload's thread.
        key = self.verdicts.key_for(handle.name, "remote")
        args = (handle, done, key)
        name = "dcp_safe-remote-verdict"
        threading.Thread(target=self._remote_verdict, args=args, name=name, daemon=True).start()

    def _remote_verdict(self, handle: SaveHandle, done: Future[Any], key: str) -> None:
        assert self.verdicts is not None
        error, reason = done.exception(), None
        try:
            if self.verdicts.coordinator:
                decided = self.verdicts.post(key, error)
                if error is None and decided is not None:  # a peer gave up waiting first
                    error, reason = decided, self._withdraw(handle, decided, "remote")
            else:  # committed by rank 0: so here too, even where this rank's own wait gave up
                decided = self.verdicts.await_verdict(key)
                if decided is None or error is None or isinstance(decided, ReplicationSkippedError):
                    error = decided
        except BaseException as exc:  # the store is gone: this rank's own outcome, said why
            error = error or exc
        self._record_replication(handle, done, error, reason)

    def _record_replication(
        self,
        handle: SaveHandle,
        done: Future[Any],
        error: BaseException | None,
        reason: str | None = None,
    ) -> None:
        if error is None:
            self.ledger.record("committed", handle, tier="remote")
            with contextlib.suppress(InvalidStateError):  # None: this rank's own wait gave up
                handle.replicated.set_result(None if done.exception() else done.result())
        elif isinstance(error, ReplicationSkippedError):  # policy, not a failure
            self.ledger.record("skipped", handle, tier="remote", reason=str(error))
            settle([handle.replicated], error)
        else:
            self.ledger.fail(handle, error, tier="remote", future=handle.replicated, reason=reason)


def _nbytes(state_dict: dict[str, Any]) -> int:
    return sum(t.nbytes for t in collect_tensors(state_dict))


def _copied(staging: Future[Any], staged: Future[None]) -> None:
    """The staging of a save ended: resolve the handle's ``staged`` (unless a failure did)."""
    with contextlib.suppress(InvalidStateError):
        try:
            staging.result()
            staged.set_result(None)
        except CancelledError:
            staged.cancel()
        except BaseException as exc:
            staged.set_exception(exc)
