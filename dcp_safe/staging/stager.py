"""``BudgetedStager``: DCP's ``AsyncStager`` with a memory budget, reusable buffers and isolation.

This module owns the life of a *generation* (one save's staged copy) from admission to release.

Call order (``dcp.async_save(state_dict, async_stager=stager, ...)``)::

    training thread   stage(state_dict): walk the state, read the guard's counters, take the
                      last plan if the structure is unchanged (else the layout's plan), admit
                      (wait or raise), lease buffers, hand over the copy, return a Future
    staging thread    allocate missing buffers, copy tensors (``_foreach_copy_`` per chunk;
                      non-blocking on a side stream on CUDA, then synchronize), confirm a taken
                      plan's key (on a miss: re-plan, re-admit, copy again), check the guard,
                      deep-copy everything else, resolve the Future -> ``staging_completion``
    upload thread     DCP's ``save()`` on the staged dict -> ``upload_completion``
    any thread        release: buffers back to the pool, generation leaves the in-flight set

A generation is released when its staged dict is dropped (a ``weakref.finalize``) or its
tracked upload future is done, whichever comes first (docs/staging.md, "Buffers and release").
Admission runs on the caller's thread, so refusals come out of ``dcp.async_save`` itself.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, replace
from functools import partial
from typing import Any, cast

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_safe.choices import refuse_moved
from dcp_safe.errors import AdmissionTimeoutError, ConfigError, DcpSafeError, SnapshotMutatedError
from dcp_safe.observe import NULL_RECORDER, Phase, Recorder, StagerObserver
from dcp_safe.staging._tree import Layout, rebuild, scan
from dcp_safe.staging.budget import Admission, MemoryBudget
from dcp_safe.staging.guard import SnapshotGuard
from dcp_safe.staging.options import STAGER_MOVED, StagerOptions, StagerStats, WhenBusy
from dcp_safe.staging.plan import (
    InFlightGeneration,
    PlanCache,
    StagedStateDict,
    StagingPlan,
    copy_sources,
)
from dcp_safe.staging.poison import poisoned
from dcp_safe.staging.pool import BufferPool, BufferRequest, Lease
from dcp_safe.staging.shared import CudaSlabPinning, SharedSlabs
from dcp_safe.torch_compat import rank_world
from dcp_safe.units import format_bytes

StateDict = dict[str, Any]

# After a weakref release the buffers may stay shared for a moment, until the dying dict has
# dropped its tensors; an admission prefers waiting this long for them to allocating anew.
_PENDING_GRACE_S = 0.05
# A full garbage collection is slow; only a wait this long pays for one.
_COLLECT_AFTER_S = 0.5


class BudgetedStager(AsyncStager, AbstractContextManager["BudgetedStager"]):
    """A DCP ``AsyncStager`` that stages into budgeted, reused host buffers.

    ``budget``: the host-memory envelope (``None``: :meth:`MemoryBudget.from_host`, now).
    ``telemetry`` records a ``staging`` span per save (admission wait and copy) and a
    ``release`` span when its buffers go back to the pool. ``shared_memory``: stage into shared
    slabs a worker process can map (:attr:`shared`; the manager's ``executor="process"``),
    page-locked as ``options.pin_memory`` says. A keyword of the earlier layout (``pin_memory=``,
    ...) is a ConfigError naming where it moved (:data:`~dcp_safe.staging.options.STAGER_MOVED`).
    ``stage``, ``track`` and ``stats`` may be called from any thread.
    """

    _synchronize_after_execute: bool = False

    def __init__(
        self,
        budget: MemoryBudget | None = None,
        *,
        options: StagerOptions | None = None,
        telemetry: StagerObserver | None = None,
        shared_memory: bool = False,
        **moved: Any,
    ) -> None:
        refuse_moved("BudgetedStager", moved, STAGER_MOVED)
        if options is not None and not isinstance(options, StagerOptions):
            raise ConfigError(f"options must be a StagerOptions, got {type(options).__name__}")
        self.options = options if options is not None else StagerOptions()
        self.telemetry: Recorder = NULL_RECORDER
        if telemetry is not None:
            telemetry.attach_stager(self)
        self.budget = budget if budget is not None else MemoryBudget.from_host()
        # Buffers a worker process can read (:mod:`dcp_safe.staging.shared`); ``None``: private.
        pinning = CudaSlabPinning() if self.options.pin_memory.resolve() else None
        self.shared = SharedSlabs(pinning=pinning) if shared_memory else None
        self._pool = BufferPool(pin_memory=self.options.pin_memory, shared=self.shared)
        self._cond = self._pool.condition
        self._plans = PlanCache(self._pool)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-stager")
        # A side stream created here, on the caller's thread, so staging never shares the
        # compute stream (as DCP's DefaultStager does).
        self._stream = (
            torch.cuda.Stream() if torch.cuda.is_available() else None  # type: ignore[no-untyped-call]
        )
        self._in_flight: dict[int, InFlightGeneration] = {}
        self._last = threading.local()
        self._kept: InFlightGeneration | None = None
        self._closed = False
        # The stager's own counters; stats() adds the pool's, the budget's and the plans'.
        self._counts = StagerStats()

    def stage(self, state_dict: StateDict) -> Future[StateDict]:
        """Admit a save (BudgetExceededError: larger than the whole envelope;
        AdmissionTimeoutError: not admitted within ``timeout_s``, at once with
        ``when_busy="raise"``) and start copying it on the staging thread; return a Future of
        the staged dict. It fails with :class:`~dcp_safe.errors.SnapshotMutatedError` when a
        source changed in place before its copy finished (in one process; several ranks:
        docs/staging.md)."""
        started = time.perf_counter()
        layout = scan(state_dict)
        with self._cond:
            # Same structure as the last save: admit on its plan and let the staging thread
            # confirm the full key, which costs several times the walk.
            plan = self._plans.speculate(layout, self._admits_now)
            confirmed = plan is None
            plan = plan or self._plans.get(layout)
        # The request is the snapshot's moment: read the counters before anything can wait.
        # Every candidate, not the plan's pick: a guessed plan may still be replaced.
        guard = SnapshotGuard(layout.candidates) if self.options.mutation_guard else None
        own_rank, world = rank_world()
        rank = own_rank if world > 1 else None  # None without a default group of several ranks
        span = self.telemetry.begin(Phase.STAGING, bytes=plan.request.nbytes)
        try:
            waited = time.monotonic()
            with self._cond:
                lease = self._lease(plan.request, None, "")
                counts = self._counts
                counts.admitted += 1
                number = counts.admitted  # the n-th admitted save is generation #n
                gen = InFlightGeneration(number, lease, span, guard, plan, rank, started, confirmed)
                self._in_flight[gen.number] = gen
                counts.peak_in_flight = max(counts.peak_in_flight, len(self._in_flight))
                counts.total_wait_s += time.monotonic() - waited
                self._last.generation = gen
        except BaseException as exc:
            span.fail(exc)
            raise
        if self._stream is not None:  # whatever the plan: a confirmed one may add CUDA sources
            gen.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gen.ready.record()  # the caller's stream: copy only what its queued kernels wrote
        # Not on the generation: a Future holds its result, and the staged dict must be free to go.
        future: Future[StateDict] = Future()
        self._executor.submit(self._copy, gen, state_dict, layout, future)
        return future

    def synchronize_staging(self) -> None:
        # DCP uses the Future instead. Copies run one at a time, in request order: once a no-op
        # submitted now has run, every copy requested so far has ended (after close(): all have).
        if not self._closed:
            self.run_on_staging_thread(lambda: None).result()

    def close(self) -> None:
        """Wait (up to ``timeout_s``) for work in flight, then free the pool; raise TimeoutError
        if it was not released in time, else the first error of a staging or tracked upload
        that was in flight."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            waiting = list(self._in_flight.values())
        self.drop_kept()
        gc.collect()  # a dropped response caught in a reference cycle still holds its state
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight, self.options.timeout_s)
            stuck = sorted(self._in_flight)
        self._executor.shutdown(wait=True)
        self._pool.close()
        if self.shared is not None:
            self.shared.close()
        if stuck:
            raise TimeoutError(
                f"close() waited {self.options.timeout_s}s for generation(s) {stuck}; their"
                " uploads have not finished, or a failed response still holds the staged state"
                " (pass responses to stager.track())"
            )
        if errors := [g.error for g in waiting if g.error is not None]:
            raise errors[0]

    def track(
        self, response: AsyncSaveResponse | Future[Any], *, keep: object | None = None
    ) -> AsyncSaveResponse | Future[Any]:
        """Release the generation this thread staged last when its upload finishes (call right
        after ``dcp.async_save`` on the same thread; a ConfigError if none is left to track).

        Success or failure, the buffers go back to the pool as soon as the upload future is
        done, and its error is kept for :meth:`close`. Returns ``response``, for chaining.

        With ``keep`` (any tag), a *successful* upload keeps the generation instead, staged
        dict and buffers, as :meth:`kept` under that tag, and releases the one kept before:
        one kept generation at most, outside ``max_in_flight`` but inside the envelope (its
        buffers stay leased). A failed upload releases as usual and leaves the kept one.
        """
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        gen: InFlightGeneration | None = getattr(self._last, "generation", None)
        if gen is None:
            raise ConfigError("track(): no untracked save was staged on this thread")
        self._last.generation = None
        gen.tracked = True
        if keep is not None:
            with self._cond:  # against _copy: whichever comes second takes the dict
                gen.keep = keep
                gen.held = None if gen.result is None else gen.result()
        upload.add_done_callback(lambda f: self._upload_done(gen, f))
        return response

    def kept(self) -> tuple[object, StagedStateDict] | None:
        """The kept generation's tag and staged dict (see :meth:`track`), if one is kept.

        The dict's tensors are the pool's buffers: read them, never keep references to them
        beyond :meth:`drop_kept` or the next kept generation."""
        with self._cond:
            gen = self._kept
            return None if gen is None or gen.held is None else (gen.keep, gen.held)

    def drop_kept(self) -> None:
        with self._cond:
            gen, self._kept = self._kept, None
        if gen is not None:
            gen.held = None
            self._release(gen, writer_done=True)

    release_after = track  # the name for a bare upload future

    def async_save(self, state_dict: StateDict, **kwargs: Any) -> AsyncSaveResponse:
        """``dcp.async_save(state_dict, async_stager=self, **kwargs)``, its response tracked."""
        from torch.distributed.checkpoint.state_dict_saver import async_save

        response = async_save(state_dict, async_stager=self, **kwargs)
        return cast(AsyncSaveResponse, self.track(response))  # a stager's save always answers so

    def warm_up(self, state_dict: StateDict) -> int:
        """Allocate and first-touch buffers for ``state_dict`` now, so its first save reuses;
        return the host bytes allocated (0 when the pool already covers the state).
        BudgetExceededError: larger than the whole envelope; AdmissionTimeoutError: the pool
        cannot grow that much while other work holds it."""
        layout = scan(state_dict)
        with self._cond:
            plan = self._plans.get(layout)
            self.budget.check_fits(plan.request.cost)
            _, new = self._pool.plan(plan.request)
            if self._pool.counts.allocated_bytes + new > self.budget.envelope_bytes:
                raise AdmissionTimeoutError(
                    f"warm_up needs {format_bytes(new)} more, but the pool holds"
                    f" {format_bytes(self._pool.counts.allocated_bytes)} of the"
                    f" {self.budget.explain()}"
                )
        return self._pool.warm(plan.request, plan.views)

    def run_on_staging_thread(self, fn: Callable[[], object]) -> Future[object]:
        """Run ``fn`` on the staging thread, after every copy requested before this call.

        Copies run one at a time, in request order, so a blocking ``fn`` holds every later
        copy (:func:`dcp_safe.testing.staging.hold_staging` relies on it).
        """
        return self._executor.submit(fn)

    def trim(self) -> int:
        """Free every buffer not in use; return the bytes freed."""
        return self._pool.trim(0)

    def stats(self) -> StagerStats:
        pool = asdict(self._pool.stats())
        with self._cond:
            return replace(
                self._counts,
                envelope_bytes=self.budget.envelope_bytes,
                pool_bytes=pool.pop("allocated_bytes"),
                peak_pool_bytes=pool.pop("peak_allocated_bytes"),
                in_flight=len(self._in_flight),
                plans_built=self._plans.builds,
                plan_reuses=self._plans.hits,
                kept_bytes=0 if self._kept is None else self._kept.lease.request.cost,
                **pool,
            )

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _lease(self, request: BufferRequest, others: int | None, why: str) -> Lease:
        # Wait (the condition held) until ``request`` is admitted, then lease its buffers.
        # ``others``: the generations in flight besides the caller's (``None``: all of them).
        started = time.monotonic()
        wait_s = 0.0 if self.options.when_busy is WhenBusy.RAISE else self.options.timeout_s
        collected = False
        grace_until: float | None = None
        while True:
            if self._closed and others is None:
                raise DcpSafeError("stage() after close()")
            admission, new = self._decide(request, others)
            now = time.monotonic()
            if admission.admitted:
                if new == 0 or self._pool.counts.pending_bytes == 0:  # plan() reclaimed
                    break
                # Just-released buffers stay viewed until their dying dict lets go of its
                # tensors; reusing them beats allocating a second copy of the state.
                grace_until = grace_until or now + _PENDING_GRACE_S
                if now >= grace_until:
                    break
            elif now >= started + wait_s:
                self._counts.refused += 1
                raise AdmissionTimeoutError(self._refusal(admission.reason + why))
            elif not collected and now - started >= _COLLECT_AFTER_S:
                collected = True
                self._cond.release()
                try:
                    gc.collect()  # reference cycles holding a dropped failed response
                finally:
                    self._cond.acquire()
                continue
            self._cond.wait(0.005)
        lease = self._pool.lease(request)
        excess = self._pool.counts.allocated_bytes - self.budget.envelope_bytes
        if excess > 0:  # free buffers this state cannot use make room for ones it can
            self._pool.trim(max(0, self._pool.counts.free_bytes - excess))
        return lease

    def _admits_now(self, plan: StagingPlan) -> bool:
        # A wrong guess must not make a save wait or fail: guess only what is admitted now.
        fits = plan.request.cost <= self.budget.envelope_bytes
        return fits and self._decide(plan.request)[0].admitted

    def _decide(self, request: BufferRequest, others: int | None = None) -> tuple[Admission, int]:
        reused, new = self._pool.plan(request)
        spare = self._pool.counts.free_bytes - reused
        admission = self.budget.admit(
            request_bytes=request.cost,
            projected_bytes=self._pool.counts.allocated_bytes + new - spare,
            in_flight=len(self._in_flight) if others is None else others,
            max_in_flight=self.options.max_in_flight,
        )
        return admission, new

    def _refusal(self, reason: str) -> str:
        held = ", ".join(
            f"#{g.number}{' (tracked)' if g.tracked else ''}" for g in self._in_flight.values()
        )
        raising = self.options.when_busy is WhenBusy.RAISE
        how = "when_busy='raise'" if raising else f"waited {self.options.timeout_s}s"
        return (
            f"save not admitted ({how}): {reason}; generations in flight: {held or 'none'}."
            " A generation is released when its upload finishes; an untracked failed upload"
            " holds its buffers until its response is dropped (use stager.track(response))"
        )

    def _copy(
        self,
        gen: InFlightGeneration,
        state_dict: StateDict,
        layout: Layout,
        future: Future[StateDict],
    ) -> None:
        try:
            copy = partial(copy_sources, gen, layout, self._stream, self.telemetry, state_dict)
            staged, allocated = self._copy_guessed(gen, layout, copy)
            if (torn := gen.torn(state_dict)) is not None:
                raise torn
            result = StagedStateDict(rebuild(state_dict, staged))
            del staged
        except BaseException as exc:
            # A resize between the request and the copy surfaces as a shape error first.
            error = gen.torn(state_dict, exc) or exc
            gen.span.fail(error)
            self._release(gen, writer_done=True)  # nothing will read these buffers
            if isinstance(error, SnapshotMutatedError):
                with self._cond:
                    self._counts.torn += 1
            if gen.rank is not None and isinstance(error, Exception):
                # A failed Future would keep this rank out of DCP's planning collective and leave
                # peers waiting for their deadline (:mod:`dcp_safe.staging.poison`).
                future.set_result(StagedStateDict(poisoned(error)))
            else:
                gen.error = error
                future.set_exception(error)
            return
        # At interpreter exit there is nothing left to reuse.
        weakref.finalize(result, self._dropped, gen).atexit = False
        with self._cond:
            gen.result = weakref.ref(result)
            if gen.keep is not None:
                gen.held = result
            self._counts.last_allocated_bytes = allocated
            self._counts.last_staging_s = time.perf_counter() - gen.started
        gen.span.end(allocated_bytes=allocated)
        future.set_result(result)

    def _copy_guessed(
        self, gen: InFlightGeneration, layout: Layout, copy: Callable[[], dict[int, torch.Tensor]]
    ) -> tuple[dict[int, torch.Tensor], int]:
        """Allocate ``gen``'s missing buffers and ``copy``; return the staged tensors and the
        bytes allocated. A plan stage() guessed is confirmed after its copy; on a miss, the
        guess's lease is swapped for the layout's own plan's, admitted like any save (so it may
        raise as stage() does), and the copy runs again.

        The key is checked after the copy: the copy releases the GIL, so the caller's
        ``async_save`` returns while it runs and the key's cost overlaps the caller's compute.
        A wrong guess is memory-safe: checked ``copy_`` calls into the guess's own buffers.
        """
        allocated = gen.lease.materialize()
        try:
            staged = copy()
            if gen.confirmed or gen.plan.key == layout.key:
                return staged, allocated
            del staged
        except Exception as exc:  # a shape or dtype mismatch: the guess was wrong, or a real error
            if gen.confirmed or isinstance(exc, SnapshotMutatedError) or gen.plan.key == layout.key:
                raise
        with self._cond:
            self._plans.hits -= 1  # the guess was counted a reuse; it did not match after all
            gen.plan = self._plans.get(layout)
            gen.lease.release(writer_done=True)  # the guess's copy: nobody reads it
            # This generation is in flight already: count only the others.
            why = " (the tensors' shapes or dtypes changed)"
            gen.lease = self._lease(gen.plan.request, len(self._in_flight) - 1, why)
        allocated += gen.lease.materialize()
        return copy(), allocated

    def _dropped(self, gen: InFlightGeneration) -> None:
        # Runs inside the dict's deallocation; its tensors are freed only after we return.
        try:
            self._executor.submit(self._release, gen, writer_done=False)
        except RuntimeError:  # executor shut down: release now, the pending check still holds
            self._release(gen, writer_done=False)

    def _upload_done(self, gen: InFlightGeneration, upload: Future[Any]) -> None:
        # A cancelled future has no exception to read: exception() would raise in this callback
        # and leave the generation in flight, its buffers leased, until close() timed out.
        exc = CancelledError() if upload.cancelled() else upload.exception()
        gen.error = gen.error or exc
        release: InFlightGeneration | None = gen
        if exc is None and gen.held is not None:
            with self._cond:
                if not self._closed:  # kept: out of the in-flight set, its buffers still leased
                    release, self._kept = self._kept, gen
                    self._in_flight.pop(gen.number, None)
                    self._cond.notify_all()
        if release is not None:
            release.held = None
            self._release(release, writer_done=True)

    def _release(self, gen: InFlightGeneration, *, writer_done: bool) -> None:
        # Only the first release ends the generation, so only it is a phase; a second one may
        # still return the buffers first (the first is opening its span outside the lock).
        with self._cond:
            first, gen.release_claimed = not gen.release_claimed, True
        span = None
        if first:
            nbytes = gen.lease.request.nbytes
            span = self.telemetry.begin(
                Phase.RELEASE, save=gen.span.save, step=gen.span.step, bytes=nbytes
            )
        with self._cond:
            gen.lease.release(writer_done=writer_done)
            self._in_flight.pop(gen.number, None)
            self._cond.notify_all()
        if span is not None:
            span.end(writer_done=writer_done)
