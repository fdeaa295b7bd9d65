"""How an admitted save runs: in the background, in the foreground, or coalesced.

Background and foreground saves use two different groups (:mod:`~dcp_safe.coordination.groups`): a
communicator carries one ordered stream of collectives, and a foreground save may run while a
background one is still in its collectives. A save whose group broke marks it broken; the next
vote replaces it on every rank.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from dcp_safe.adapters import api
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.coordination.groups import BACKGROUND, FOREGROUND, ManagerGroups
from dcp_safe.coordination.store import PromotionBarrier
from dcp_safe.errors import DrainTimeoutError, SnapshotMutatedError
from dcp_safe.manager.follow_up import FollowUp
from dcp_safe.manager.handles import Pending, SaveHandle, StagingMode, chain
from dcp_safe.manager.in_memory import InMemoryTier
from dcp_safe.manager.ledger import Ledger, SaveSpans
from dcp_safe.manager.slot import SaveSlot
from dcp_safe.staging import BudgetedStager
from dcp_safe.staging._tree import collect_tensors, state_dicts_of
from dcp_safe.staging.guard import snapshot_copy
from dcp_safe.worker.parent import SaveWorker

__all__ = ["SaveRunner"]


@dataclass(kw_only=True, eq=False)
class SaveRunner:
    """Runs admitted saves over the manager's parts.

    Args:
        writer: the manager's writer (background saves).
        slot: the single-flight slot (held by the caller of :meth:`start`).
        groups, barrier: ``None`` in a single process.
        worker: runs background saves in a worker process (``executor="process"``) once every
            rank's is ready (a save's agreed ``worker`` flag); ``None``, and until then: on
            DCP's upload thread here.
    """

    writer: SafeStorageWriter
    stager: BudgetedStager
    staging: StagingMode
    slot: SaveSlot
    ledger: Ledger
    spans: SaveSpans
    follow_up: FollowUp
    cond: threading.Condition
    groups: ManagerGroups | None = None
    barrier: PromotionBarrier | None = None
    per_rank: tuple[str, ...] = ()
    in_memory: InMemoryTier | None = None  # keep_in_memory=True
    worker: SaveWorker | None = None
    # The agreed coalesce decisions so far: a pending save's ``seq``.
    _coalesced: int = field(default=0, init=False)
    sync_writer: SafeStorageWriter | None = field(default=None, init=False)
    _last_staged: Future[None] | None = field(default=None, init=False)
    post: ThreadPoolExecutor = field(init=False)  # the manager thread

    def __post_init__(self) -> None:
        self.post = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-manager")

    @contextlib.contextmanager
    def collectives(self, purpose: str) -> Iterator[dict[str, Any]]:
        """DCP's keyword arguments for a save or load on ``purpose``'s group; a failure inside
        that broke the group marks it (:meth:`saw_failure`)."""
        kwargs = {"no_dist": True} if self.groups is None else self.groups.collectives(purpose)
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
        keep = None
        if self.in_memory is not None:
            self.in_memory.check_room(state_dict)
            keep = handle
        if worker and self.worker is not None:
            with self.spans.opened(handle):  # as dcp.async_save: a model by its state dict
                staged = self.stager.stage(state_dicts_of(state_dict))
            upload = self.worker.submit(handle.name, handle.step, staged)
            self.stager.track(upload, keep=keep)
            self.ledger.count("worker_saves")
            self._started(handle, staged, upload, None, self.worker)
            return
        writer = self.writer.for_step(handle.step)
        with self.collectives(BACKGROUND) as collectives, self.spans.opened(handle):
            response = api.async_save(
                state_dict,
                checkpoint_id=handle.name,
                storage_writer=self.spans.wrap(writer),
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
        """Follow a started save (``worker``: the one running it): its copy (the handle's
        ``staged``), then its upload."""
        chain(staged, handle.staged, lambda _: None)
        with self.cond:
            self._last_staged = handle.staged
        upload.add_done_callback(lambda done: self._follow(handle, done, group, worker))
        if self.staging is StagingMode.SNAPSHOT:
            # The copy is bounded and budgeted; its failure (a torn snapshot from another
            # thread) reaches the handle's futures and the history, not this call.
            wait_futures([handle.staged], timeout=self.stager.options.timeout_s)

    def wait_staged(self, timeout_s: float | None) -> None:
        """Block until the latest started save has copied the state.

        Raises:
            DrainTimeoutError: the copy was not done after ``timeout_s``.
        """
        with self.cond:
            staged = self._last_staged
        if staged is not None and wait_futures([staged], timeout=timeout_s).not_done:
            raise DrainTimeoutError(f"the state was still being copied after {timeout_s} s")

    def foreground(self, handle: SaveHandle, state_dict: dict[str, Any]) -> None:
        """Save ``handle`` now, synchronously, on the writer's twin (its uploads are its own,
        since an asynchronous save may be running on the writer), then follow its commit up."""
        if self.sync_writer is None:
            self.sync_writer = self.writer.detached()
        writer = self.sync_writer.for_step(handle.step)
        self.ledger.count("sync_saves")
        try:
            with self.collectives(FOREGROUND) as collectives, self.spans.opened(handle):
                api.save(
                    state_dict,
                    checkpoint_id=handle.name,
                    storage_writer=self.spans.wrap(writer),
                    per_rank=self.per_rank,
                    **collectives,
                )
        except BaseException as exc:
            self.ledger.fail(handle, exc, tier="local", keep=False)
            raise
        handle.staged.set_result(None)
        self.follow_up.after_commit(handle, writer)

    def coalesce(
        self, handle: SaveHandle, state_dict: dict[str, Any], worker: bool = False
    ) -> SaveHandle | None:
        """Copy the state now and make it the pending save (started at once if the slot is
        free meanwhile; in the worker if ``worker``, as agreed now). The admission checked the
        budget has room for the copy.

        Called for an agreed ``COALESCE`` decision, on every rank, with the slot frozen."""
        need = sum(t.nbytes for t in collect_tensors(state_dict))
        self._coalesced += 1  # counted before the copy can fail: the same on every rank
        try:  # another thread may update the state while it is copied
            state = snapshot_copy(state_dict)
        except SnapshotMutatedError as exc:
            self.ledger.fail(handle, exc, tier="local")
            if self.barrier is not None:  # the peers' copy of this pending save starts nowhere
                self.barrier.abandon(self._coalesced)
            return handle
        handle.staged.set_result(None)
        pending = Pending(handle, state, need, seq=self._coalesced, worker=worker)
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
                self.post.submit(self._run_pending, pending)
        return handle

    def drop_pending(self) -> Pending | None:
        """Take the pending save out, never to start it (its barrier is abandoned)."""
        pending = self.slot.drop_pending()
        if pending is not None and self.barrier is not None:
            self.barrier.abandon(pending.seq)
        return pending

    def _follow(
        self, handle: SaveHandle, upload: Future[Any], group: Any, worker: SaveWorker | None
    ) -> None:
        """The upload ended: follow it up on the manager thread (here, if a close that gave up
        on it has stopped that thread: its handle is resolved already, the slot is not)."""
        try:
            self.post.submit(self._after_upload, handle, upload, group, worker)
        except RuntimeError:
            self._after_upload(handle, upload, group, worker)

    def _after_upload(
        self, handle: SaveHandle, upload: Future[Any], group: Any, worker: SaveWorker | None
    ) -> None:
        """On the manager thread: follow the commit up, then free the slot."""
        try:
            self.saw_failure(BACKGROUND, upload.exception(), group)
            self.follow_up.after_upload(handle, upload, self.writer, worker)
        finally:
            self._finish_slot()

    def _finish_slot(self) -> None:
        """Free the slot, or hand it straight to the pending coalesced save."""
        pending = self.slot.release()
        if pending is not None:
            self.ledger.count("started")
            self._run_pending(pending)

    def _run_pending(self, pending: Pending | None) -> None:
        """Start the pending save that holds the slot; on failure free the slot (or hand it on).

        A start that fails fails the pending save's handle and is kept for ``wait``/``close``;
        one the ranks' barrier abandoned is skipped, on every rank alike."""
        while pending is not None:
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
            pending = self.slot.release()
            if pending is not None:
                self.ledger.count("started")

    def saw_failure(self, purpose: str, error: BaseException | None, group: Any) -> None:
        """A save or load on ``group`` ended with ``error``: mark the group if that broke it."""
        if self.groups is not None and self.groups.saw_failure(purpose, error, group):
            self.ledger.count("groups_broken")
