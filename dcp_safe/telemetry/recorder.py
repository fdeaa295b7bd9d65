"""``Telemetry``: the recorder that turns spans, marks and steps into events for the sinks, and
:class:`InstrumentedWriter`, the wrapper that times a writer's DCP calls for it (which call
opens which span: docs/telemetry.md, "What is recorded"; ``reset`` also opens the save's root
span when none is open, as under a plain ``dcp.save``). A wrapper, not hooks, so the writer
stays free of telemetry and telemetry off wraps nothing.

One instance serves one process; its saves in flight switch the memory sampler between its fast
and slow rates. Parent resolution, because phases cross threads: an explicit ``parent``; else
the span opened by :meth:`Telemetry.span` / :meth:`Telemetry.within` on this thread; else the
open root span of the same checkpoint name (the upload thread knows only the name).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future as Future_
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Unpack, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_safe.errors import describe
from dcp_safe.observe import Instrumentable, Phase, SpanHandle, SpanOptions
from dcp_safe.telemetry.memory import MemorySample, MemorySampler, anchored_clock
from dcp_safe.telemetry.report import TelemetryReport, build_report
from dcp_safe.telemetry.sinks import Event, EventKind, MemorySink, Sink
from dcp_safe.topology import Topology
from dcp_safe.torch_compat import rank_world

log = logging.getLogger(__name__)

_ROOT_LEVEL = frozenset({Phase.SAVE, Phase.RELEASE, Phase.REPLICATION})


@dataclass(slots=True, eq=False)
class _Span:
    """An open span of :class:`Telemetry`; the first ``end``/``fail`` counts."""

    _owner: Telemetry
    id: int
    phase: Phase
    parent: _Span | None
    save: str | None
    step: int | None
    bytes: int | None
    t0: float
    _done: bool = False

    def end(self, *, bytes: int | None = None, **attrs: Any) -> None:
        self._owner._closed(self, True, None, self.bytes if bytes is None else bytes, attrs)

    def fail(self, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else describe(error)
        self._owner._closed(self, False, text, self.bytes, {})


class Telemetry(AbstractContextManager["Telemetry"]):
    """Spans, marks, steps and memory samples of checkpointing, sent to ``sinks`` (besides the
    in-memory sink the report reads, which keeps ``max_events``).

    ``sample_memory`` runs a :class:`MemorySampler` (started now, stopped by :meth:`close`) at
    the busy rate while a save is in flight; a given ``sampler`` is only read (not wired, started
    or stopped here). ``rank`` defaults to this process's rank (0 without a group).
    """

    enabled = True

    def __init__(
        self,
        *,
        sinks: Sequence[Sink] = (),
        sample_memory: bool = True,
        busy_interval_s: float = 0.02,
        idle_interval_s: float = 1.0,
        sampler: MemorySampler | None = None,
        rank: int | None = None,
        clock: Callable[[], float] | None = None,
        max_events: int = 100_000,
    ) -> None:
        self.clock = clock or anchored_clock()
        if rank is None:
            rank = rank_world()[0]
        self.rank = rank
        self.memory = MemorySink(max_events)
        self.sinks: tuple[Sink, ...] = (self.memory, *sinks)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._roots: dict[str, _Span] = {}
        self._local = threading.local()
        self._stagers: dict[Instrumentable, None] = {}  # an ordered set
        self._last_step_t: float | None = None
        # The sampler started here (and stopped by close()); a given one is only read.
        self._own: MemorySampler | None = None
        self.sampler = sampler
        if sampler is None and sample_memory:
            self.sampler = self._own = MemorySampler(
                busy_interval_s=busy_interval_s,
                idle_interval_s=idle_interval_s,
                pinned_bytes=self._pinned_bytes,
                saves_in_flight=self.saves_in_flight,
                on_sample=self._sampled,
                clock=self.clock,
            ).start()

    def begin(
        self,
        phase: Phase,
        *,
        save: str | None = None,
        step: int | None = None,
        parent: SpanHandle | None = None,
        bytes: int | None = None,
    ) -> SpanHandle:
        """Open a span (see the module docstring for how its parent is found)."""
        phase = Phase(phase)
        up = self._resolve_parent(parent, save, phase)
        if up is not None:  # a child inherits what it was not told
            save, step = up.save if save is None else save, up.step if step is None else step
        span = _Span(self, next(self._ids), phase, up, save, step, bytes, self.clock())
        if phase is Phase.SAVE and save is not None:
            with self._lock:
                self._roots[save] = span
            if self._own is not None:
                self._own.mark_busy()
        self._record_span(EventKind.SPAN_START, span, span.t0, bytes=bytes)
        return span

    def begin_save(self, name: str, step: int | None = None) -> SpanHandle:
        """Open the root span of save ``name``; the sampler samples fast until it ends."""
        return self.begin(Phase.SAVE, save=name, step=step)

    @contextmanager
    def span(self, phase: Phase, **options: Unpack[SpanOptions]) -> Iterator[SpanHandle]:
        """A span on this thread, with a profiler range; an exception fails it (re-raised)."""
        span = self.begin(phase, **options)
        try:
            with self.within(span), self.profile(Phase(phase)):
                yield span
        except BaseException as exc:
            span.fail(exc)
            raise
        span.end()

    @contextmanager
    def within(self, span: SpanHandle) -> Iterator[SpanHandle]:
        """Make ``span`` this thread's current span (the default parent) inside the block."""
        stack: list[SpanHandle] = self._local.__dict__.setdefault("stack", [])
        stack.append(span)
        try:
            yield span
        finally:
            stack.pop()

    def profile(self, phase: Phase) -> AbstractContextManager[Any]:
        """A ``torch.profiler.record_function`` range named ``dcp_safe::<phase>``."""
        return torch.profiler.record_function(f"dcp_safe::{Phase(phase).value}")

    def mark(
        self, name: str, *, save: str | None = None, step: int | None = None, **attrs: Any
    ) -> None:
        """A point event: ``skipped``, ``fallback``, ``retry`` (counted by the Prometheus sink)."""
        self._record(EventKind.MARK, name, self.clock(), save=save, step=step, attrs=attrs)

    def step(self, step: int | None = None) -> float | None:
        """Report that a training step ended; returns the seconds since the previous call."""
        now = self.clock()
        with self._lock:
            last, self._last_step_t = self._last_step_t, now
        if last is None:
            return None
        duration = now - last
        self._record(EventKind.STEP, "step", now, step=step, duration_s=duration)
        return duration

    def adopt(self, events: Sequence[Event], parent: SpanHandle | None) -> int:
        """Record the nested spans another process recorded for one save (the checkpoint
        worker's plan, write and commit with ``executor="process"``); returns how many.

        Each span gets an id of this recorder and this recorder's rank, and keeps its times
        (both processes read wall time on the same host). A span the other process nested under
        one of its root-level spans (its own ``save`` root) hangs under ``parent`` here. Its
        root-level spans are not recorded (``parent`` stands for them; a replication span there
        ends after the reply that carried these events), nor spans not both started and ended
        among ``events``.
        """
        spans = [e for e in events if e.kind in (EventKind.SPAN_START, EventKind.SPAN_END)]
        ended = {e.span for e in spans if e.kind is EventKind.SPAN_END}
        up = None if parent is None else parent.id
        ids: dict[int | None, int | None] = {
            e.span: up if e.parent is None else next(self._ids)
            for e in spans
            if e.kind is EventKind.SPAN_START
        }
        kept = [e for e in spans if e.parent is not None and e.span in ended and e.span in ids]
        for e in kept:
            self._emit(replace(e, rank=self.rank, span=ids[e.span], parent=ids.get(e.parent, up)))
        return sum(e.kind is EventKind.SPAN_END for e in kept)

    def root(self, save: str) -> SpanHandle | None:
        """The open root span of save ``save`` (``None``: none is open)."""
        with self._lock:
            return self._roots.get(save)

    def follow_replication(self, save: str, replication: Future_[Any]) -> None:
        """A ``replication`` span of ``save``, ended with the outcome of ``replication`` (bytes:
        its manifest's)."""
        span = self.begin(Phase.REPLICATION, save=save)

        def ended(done: Future_[Any]) -> None:
            if done.cancelled():
                span.fail("cancelled")
            elif (error := done.exception()) is not None:
                span.fail(error)
            else:
                span.end(bytes=getattr(done.result(), "total_bytes", None))

        replication.add_done_callback(ended)

    def saves_in_flight(self) -> int:
        return len(self._roots)

    def attach_stager(self, stager: Instrumentable) -> Instrumentable:
        """Record ``stager``'s staging and release spans; sample its pinned bytes."""
        stager.telemetry = self
        with self._lock:
            self._stagers[stager] = None
        return stager

    def add_sink(self, sink: Sink) -> None:
        """Send every later event and sample to ``sink`` too."""
        with self._lock:
            self.sinks = (*self.sinks, sink)

    def stagers(self) -> list[Instrumentable]:
        with self._lock:
            return list(self._stagers)

    def wrap_writer(self, writer: Any) -> InstrumentedWriter:
        """``writer`` behind a delegating ``StorageWriter`` that records plan/write/commit spans."""
        return InstrumentedWriter(writer, self)

    def on_retry(self, delay_s: float) -> None:
        """Mark a ``retry`` (pass as ``RetryPolicy(on_retry=telemetry.on_retry)``)."""
        self.mark("retry", delay_s=delay_s)

    def report(self) -> TelemetryReport:
        """The save report over what was recorded so far."""
        samples = self.sampler.samples() if self.sampler is not None else []
        return build_report(self.memory.events(), samples)

    def close(self) -> None:
        """Stop the sampler (if started here) and close every sink. Idempotent."""
        if self._own is not None:
            self._own.stop()
        for sink in self.sinks:
            sink.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _resolve_parent(
        self, parent: SpanHandle | None, save: str | None, phase: Phase
    ) -> _Span | None:
        if isinstance(parent, _Span):
            return parent
        if phase in _ROOT_LEVEL:  # these may outlive the save: never nested implicitly
            return None
        stack = getattr(self._local, "stack", None)
        if stack and isinstance(stack[-1], _Span):
            return stack[-1]
        return None if save is None else self._roots.get(save)

    def _closed(
        self, span: _Span, ok: bool, error: str | None, nbytes: int | None, attrs: dict[str, Any]
    ) -> None:
        # The first end or fail counts.
        with self._lock:
            if span._done:
                return
            span._done = True
            if span.phase is Phase.SAVE and self._roots.get(span.save or "") is span:
                del self._roots[span.save or ""]
        if span.phase is Phase.SAVE and self._own is not None:
            self._own.mark_idle()
        t = self.clock()
        fields = {"duration_s": t - span.t0, "ok": ok, "error": error, "attrs": attrs}
        self._record_span(EventKind.SPAN_END, span, t, bytes=nbytes, **fields)

    def _record_span(self, kind: EventKind, span: _Span, t: float, **fields: Any) -> None:
        parent = None if span.parent is None else span.parent.id
        name, save, step = span.phase.value, span.save, span.step
        self._record(kind, name, t, span=span.id, parent=parent, save=save, step=step, **fields)

    def _record(self, kind: EventKind, name: str, t: float, **fields: Any) -> None:
        self._emit(Event(kind=kind, name=name, t=t, rank=self.rank, **fields))

    def _emit(self, event: Event) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:  # one broken sink must not fail a save; it is logged
                log.exception("dcp_safe: telemetry sink %r failed", sink)

    def _sampled(self, sample: MemorySample) -> None:
        for sink in self.sinks:
            sink.sample(sample)

    def _pinned_bytes(self) -> int | None:
        stagers = self.stagers()
        return sum(int(s.stats().pinned_bytes) for s in stagers) if stagers else None


class InstrumentedWriter(StorageWriter):
    """``writer`` with plan/write/commit/replication spans recorded to ``telemetry``."""

    def __init__(self, writer: Any, telemetry: Telemetry) -> None:
        super().__init__()
        self.inner = writer
        self.telemetry = telemetry
        self._name: str | None = None
        # Only when this wrapper opened it; None: the recorder finds the root by name.
        self._root: SpanHandle | None = None
        self._plan: SpanHandle | None = None
        self._coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # Still open: another rank failed, so DCP never called finish() here; close them.
        self._fail_open("a new save started before this one finished")
        self._name = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._guard(self.inner.reset, checkpoint_id)
        if self._name is None:
            return
        tel = self.telemetry
        if tel.root(self._name) is None:
            self._root = tel.begin_save(self._name, getattr(self.inner, "step", None))
        self._plan = tel.begin(Phase.PLAN, save=self._name, parent=self._root)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        self._guard(self.inner.set_up_storage_writer, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return cast(SavePlan, self._guard(self.inner.prepare_local_plan, plan))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return cast(list[SavePlan], self._guard(self.inner.prepare_global_plan, plans))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        opened, self._plan = self._plan, None
        if opened is not None:
            opened.end()
        with self._phase(Phase.WRITE) as span:
            future: Future[list[WriteResult]] = self.inner.write_data(plan, planner)
            results = future.wait()
            span.end(bytes=sum(r.size_in_bytes for r in results), items=len(results))
        if not self._coordinator:
            self._close_root()  # finish() runs on the coordinator only
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        nbytes = sum(r.size_in_bytes for rank in results for r in rank)
        with self._phase(Phase.COMMIT) as span:
            self.inner.finish(metadata, results)
            span.end(bytes=nbytes)
        self._close_root()
        topology: Topology | None = getattr(self.inner, "topology", None)
        if self._name is None or topology is None or topology.uploads_to is None:
            return
        self.telemetry.follow_replication(self._name, self.inner.replication(self._name))

    def storage_meta(self) -> StorageMeta | None:
        return cast(StorageMeta | None, self.inner.storage_meta())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # DCP asks this only of writer classes it might pick by itself, never of an instance
        # passed as storage_writer=; a wrapper is never picked, so it claims nothing.
        return False

    def __getattr__(self, name: str) -> Any:
        # Everything else (checkpoint_id, root, replication, ...) is the inner writer's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextmanager
    def _phase(self, phase: Phase) -> Iterator[SpanHandle]:
        """A span of ``phase`` over the block; an exception fails it and the root (re-raised)."""
        try:
            with self.telemetry.span(phase, save=self._name, parent=self._root) as span:
                yield span
        except BaseException as exc:
            self._close_root(exc)
            raise

    def _guard(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except BaseException as exc:
            self._fail_open(exc)
            raise

    def _close_root(self, error: BaseException | str | None = None) -> None:
        root, self._root = self._root, None
        if root is not None:
            root.end() if error is None else root.fail(error)

    def _fail_open(self, error: BaseException | str) -> None:
        opened, self._plan = self._plan, None
        if opened is not None:
            opened.fail(error)
        self._close_root(error)
