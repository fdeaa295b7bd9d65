"""``Telemetry``: the recorder that turns spans, marks and steps into events for the sinks.

It owns span ids, parent resolution, the saves in flight (which switch the memory sampler between
its fast and slow rates), the step clock, and fan-out to the sinks. One instance serves one process;
pass it to :class:`~dcp_safe.manager.CheckpointManager` (``runtime=Runtime(telemetry=)``), to a
:class:`~dcp_safe.staging.BudgetedStager` (``telemetry=`` or :meth:`Telemetry.attach_stager`) or
wrap a writer with :meth:`Telemetry.wrap_writer`.

Parent resolution, because phases cross threads: an explicit ``parent``; else the span opened
by :meth:`Telemetry.span` / :meth:`Telemetry.within` on this thread; else the open root span of
the same checkpoint name (the upload thread knows only the name, from ``reset``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Unpack

import torch

from dcp_safe.observe import Instrumentable, Phase, SpanHandle, SpanOptions
from dcp_safe.telemetry.memory import MemorySample, MemorySampler, anchored_clock
from dcp_safe.telemetry.sinks import Event, EventKind, MemorySink, Sink

if TYPE_CHECKING:
    from dcp_safe.telemetry.instrument import InstrumentedWriter
    from dcp_safe.telemetry.report import TelemetryReport

__all__ = ["Telemetry"]

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
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._owner._closed(self, False, text, self.bytes, {})


class Telemetry(AbstractContextManager["Telemetry"]):
    """Spans, marks, steps and memory samples of checkpointing, sent to ``sinks``.

    Args:
        sinks: where events go besides the built-in in-memory sink the report reads.
        sample_memory: run a :class:`MemorySampler` (started now, stopped by :meth:`close`).
        busy_interval_s, idle_interval_s: the sampler's rates (busy: a save is in flight).
        sampler: a sampler to use instead (its ``on_sample``/``saves_in_flight`` are not wired;
            it is not started or stopped here).
        rank: recorded in every event (default: this process's rank, 0 without a group).
        clock: epoch seconds for event times (tests inject one).
        max_events: events kept in memory for :meth:`report`.
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
        self.rank = _current_rank() if rank is None else rank
        self.memory = MemorySink(max_events)
        self.sinks: tuple[Sink, ...] = (self.memory, *sinks)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._roots: dict[str, _Span] = {}
        self._local = threading.local()
        self._stagers: list[Instrumentable] = []
        self._last_step_t: float | None = None
        self.step_times_s: deque[float] = deque(maxlen=max_events)
        self._owns_sampler = sampler is None and sample_memory
        self.sampler = sampler
        if self._owns_sampler:
            self.sampler = MemorySampler(
                busy_interval_s=busy_interval_s,
                idle_interval_s=idle_interval_s,
                pinned_bytes=self._pinned_bytes,
                saves_in_flight=self.saves_in_flight,
                on_sample=self._sampled,
                clock=self.clock,
            ).start()

    # -- spans ----------------------------------------------------------------------------------

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
        if up is not None:
            save = save if save is not None else up.save
            step = step if step is not None else up.step
        span = _Span(self, next(self._ids), phase, up, save, step, bytes, self.clock())
        if phase is Phase.SAVE and save is not None:
            with self._lock:
                self._roots[save] = span
            if self._owns_sampler and self.sampler is not None:
                self.sampler.mark_busy()
        self._record_span(EventKind.SPAN_START, span, span.t0, bytes=bytes)
        return span

    def begin_save(self, name: str, step: int | None = None) -> SpanHandle:
        """Open the root span of save ``name``; the sampler samples fast until it ends."""
        return self.begin(Phase.SAVE, save=name, step=step)

    def root(self, name: str) -> SpanHandle | None:
        """The open root span of save ``name``, if any."""
        with self._lock:
            return self._roots.get(name)

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
        self.step_times_s.append(duration)
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
        ids: dict[int | None, int | None] = {}
        for event in spans:
            if event.kind is EventKind.SPAN_START:
                ids[event.span] = up if event.parent is None else next(self._ids)
        adopted = 0
        for event in spans:
            if event.parent is None or event.span not in ended or event.span not in ids:
                continue
            adopted += event.kind is EventKind.SPAN_END
            parent_id = ids.get(event.parent, up)
            self._emit(replace(event, rank=self.rank, span=ids[event.span], parent=parent_id))
        return adopted

    def saves_in_flight(self) -> int:
        """Root spans open now."""
        with self._lock:
            return len(self._roots)

    # -- wiring ---------------------------------------------------------------------------------

    def attach_stager(self, stager: Instrumentable) -> Instrumentable:
        """Record ``stager``'s staging and release spans; sample its pinned bytes."""
        stager.telemetry = self
        with self._lock:
            if stager not in self._stagers:
                self._stagers.append(stager)
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
        from dcp_safe.telemetry.instrument import InstrumentedWriter

        return InstrumentedWriter(writer, self)

    def on_retry(self, delay_s: float) -> None:
        """Mark a ``retry`` (pass as ``RetryPolicy(on_retry=telemetry.on_retry)``)."""
        self.mark("retry", delay_s=delay_s)

    def report(self) -> TelemetryReport:
        """The save report over what was recorded so far."""
        from dcp_safe.telemetry.report import build_report

        samples = self.sampler.samples() if self.sampler is not None else []
        return build_report(self.memory.events(), samples)

    def close(self) -> None:
        """Stop the sampler (if started here) and close every sink. Idempotent."""
        if self._owns_sampler and self.sampler is not None:
            self.sampler.stop()
        for sink in self.sinks:
            sink.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

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
        if save is not None:
            with self._lock:
                return self._roots.get(save)
        return None

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
        if span.phase is Phase.SAVE and self._owns_sampler and self.sampler is not None:
            self.sampler.mark_idle()
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


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0
