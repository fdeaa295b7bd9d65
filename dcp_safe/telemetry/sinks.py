"""Telemetry events and where they go: the :class:`Event` record (one JSON line each, schema
:data:`SCHEMA_VERSION`), the sink interface, and the in-memory, JSON-lines and Prometheus sinks.

The vocabulary the instrumented components use (phases, spans, the recorder protocol and the
null recorder) lives one layer down, in :mod:`dcp_safe.observe`, so those components never
import telemetry. Sinks are called on the thread that produced the event (training, staging,
upload, replicator, sampler threads), so each one locks its own state; none blocks for long.

The Prometheus metric names are listed in docs/telemetry.md. Every metric lives in the sink's
own ``CollectorRegistry``, never the process-wide default, so two sinks never collide and
nothing is exported unasked; ``prometheus_client`` is an optional extra, imported only when a
sink is made.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

from dcp_safe.errors import ConfigError
from dcp_safe.observe import Phase

if TYPE_CHECKING:
    from dcp_safe.telemetry.memory import MemorySample
    from dcp_safe.telemetry.recorder import Telemetry

SCHEMA_VERSION = 1


class EventKind(str, enum.Enum):
    """What one :class:`Event` line records."""

    SPAN_START = "span_start"
    SPAN_END = "span_end"
    MARK = "mark"  # a point event: skipped, fallback, retry
    STEP = "step"  # one training step reported by the loop


@dataclass(frozen=True, kw_only=True)
class Event:
    """One telemetry event; :meth:`to_dict` is exactly one JSON line of schema version 1."""

    kind: EventKind
    name: str  # the phase (spans), the mark's name, or "step"
    t: float  # seconds since the epoch (a monotonic clock anchored to wall time once)
    rank: int = 0
    span: int | None = None  # unique within one Telemetry
    parent: int | None = None
    save: str | None = None
    step: int | None = None
    bytes: int | None = None
    duration_s: float | None = None  # span_end and step only
    ok: bool | None = None  # span_end only
    error: str | None = None  # span_end only: "Type: message" of the failure
    attrs: Mapping[str, Any] = field(default_factory=dict)  # anything else, JSON-compatible

    def to_dict(self) -> dict[str, Any]:
        """The JSON-lines form: every field, plus ``schema``."""
        fields = {"kind": self.kind.value, "attrs": dict(self.attrs), "schema": SCHEMA_VERSION}
        return {**asdict(self), **fields}


class Sink:
    """Base of every sink: override what you need; the defaults ignore the call."""

    def emit(self, event: Event) -> None: ...

    def sample(self, sample: MemorySample) -> None: ...  # on the sampler's thread

    def close(self) -> None: ...


class MemorySink(Sink):
    """Keeps the newest ``max_events`` events in memory (tests, the report)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, kind: EventKind | None = None) -> list[Event]:
        """A copy of the events kept, oldest first (only ``kind`` when given)."""
        with self._lock:
            return [e for e in self._events if kind is None or e.kind is kind]


class JsonLinesSink(Sink):
    """Appends one JSON object per line to ``path`` (schema in ``docs/telemetry.md``); memory
    samples too (``kind: "sample"``) with ``include_samples``, off by default because the
    sampler runs every few tens of milliseconds during saves."""

    def __init__(self, path: str | os.PathLike[str], *, include_samples: bool = False) -> None:
        self.path = os.fspath(path)
        self.include_samples = include_samples
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        self._write(event.to_dict())

    def sample(self, sample: MemorySample) -> None:
        if self.include_samples:
            self._write({"schema": SCHEMA_VERSION, "kind": "sample", **sample.to_dict()})

    def _write(self, record: dict[str, object]) -> None:
        line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return  # closed: late events from background threads are dropped
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# Phase durations span 1 ms (small commits) to an hour (large uploads to a slow store).
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
_BYTES_BUCKETS = tuple(float(2**e) for e in range(20, 42, 2))  # 1 MiB .. 2 TiB
_MEMORY_GAUGES = {
    "rss_bytes": "Resident set size of this process.",
    "pss_bytes": "Proportional set size of this process.",
    "uss_bytes": "Unique (private) set size of this process.",
    "cgroup_current_bytes": "Memory charged to this process's cgroup.",
    "cgroup_peak_bytes": "High-water mark of the cgroup's memory.",
    "host_available_bytes": "MemAvailable of the host.",
    "locked_bytes": "Locked (mlocked) memory of this process.",
    "pinned_bytes": "Pinned host memory held by the staging pool.",
    "major_faults": "Major page faults of this process since it started.",
    "swap_in_pages": "Pages swapped in on the host since boot.",
    "swap_out_pages": "Pages swapped out on the host since boot.",
}


class PrometheusSink(Sink):
    """Counters, gauges and histograms of saves, updated from events and samples. Given a
    ``telemetry``, the sink adds itself to it, and the budget gauges read its attached stagers
    at scrape time. A ConfigError when ``prometheus_client`` is not installed.
    """

    def __init__(self, telemetry: Telemetry | None = None, *, namespace: str = "dcp_safe") -> None:
        try:
            import prometheus_client as c
        except ImportError:
            raise ConfigError(
                "the Prometheus sink needs prometheus_client: pip install dcp-safe[telemetry]"
            ) from None
        self._client, ns, self._telemetry = c, namespace, telemetry
        self.registry = reg = c.CollectorRegistry(auto_describe=True)

        def metric(kind: Any, name: str, text: str, *labels: str, **options: Any) -> Any:
            return kind(f"{ns}_{name}", text, labels, registry=reg, **options)

        seconds, counter = {"buckets": _SECONDS_BUCKETS}, c.Counter
        self.saves = metric(counter, "saves", "Saves finished, by outcome.", "outcome")
        self.in_flight = metric(c.Gauge, "saves_in_flight", "Saves started, not finished.")
        self.phase_seconds = metric(
            c.Histogram, "phase_duration_seconds", "Duration of each save phase.", "phase",
            "outcome", **seconds,
        )  # fmt: skip
        self.phase_bytes = metric(counter, "phase_bytes", "Bytes moved by each phase.", "phase")
        self.save_bytes = metric(
            c.Histogram, "save_bytes", "Bytes written per save.", buckets=_BYTES_BUCKETS
        )
        self.marks = {  # by the mark's name
            "skipped": metric(counter, "skips", "Save requests skipped or coalesced away."),
            "fallback": metric(counter, "fallbacks", "Switches to synchronous saves."),
            "retry": metric(
                counter, "retries", "Storage operations retried after a transient failure."
            ),
        }
        # From the manager's ``save_interval`` mark at each commit; the source by the reason.
        self.intervals = {
            "save_interval_s": metric(c.Gauge, "save_interval_seconds", "Time between saves."),
            "expected_loss_per_hour_s": metric(
                c.Gauge, "expected_loss_per_hour_seconds", "Expected work lost per hour."
            ),
        }
        self.interval_source = metric(c.Enum, "save_interval_source", "Its cause.", states=_SOURCES)
        self.step_seconds = metric(
            c.Histogram, "step_duration_seconds", "Training step time reported by the loop.",
            **seconds,
        )  # fmt: skip
        # Read at scrape time from the latest sample: the sampler runs every 20 ms during a
        # save, scrapes come every few seconds, and a figure the host lacks is left out.
        self._latest: MemorySample | None = None
        self._memory_prefix = f"{ns}_memory_"
        # A collector too: collect() yields the memory gauges (none yet, so nothing is
        # described up front: they vary with what the host exposes).
        reg.register(self)
        envelope = metric(c.Gauge, "budget_envelope_bytes", "The staging budget's envelope.")
        envelope.set_function(functools.partial(self._stager_sum, "envelope_bytes"))
        used = metric(c.Gauge, "budget_used_bytes", "Host bytes the staging pool holds.")
        used.set_function(functools.partial(self._stager_sum, "pool_bytes"))
        if telemetry is not None:
            telemetry.add_sink(self)

    def emit(self, event: Event) -> None:
        if event.kind is EventKind.SPAN_START and event.name == Phase.SAVE.value:
            self.in_flight.inc()
        elif event.kind is EventKind.SPAN_END:
            self._span_end(event)
        elif event.kind is EventKind.MARK and event.name == "save_interval":
            self._interval(event.attrs)
        elif event.kind is EventKind.MARK and event.name in self.marks:
            self.marks[event.name].inc()
        elif event.kind is EventKind.STEP and event.duration_s is not None:
            self.step_seconds.observe(event.duration_s)

    def _span_end(self, event: Event) -> None:
        outcome = "ok" if event.ok else "error"
        self.phase_seconds.labels(event.name, outcome).observe(event.duration_s or 0.0)
        if event.bytes:
            self.phase_bytes.labels(event.name).inc(event.bytes)
        if event.name == Phase.SAVE.value:
            self.in_flight.dec()
            self.saves.labels(outcome).inc()
        elif event.name == Phase.WRITE.value and event.ok and event.bytes is not None:
            self.save_bytes.observe(event.bytes)

    def _interval(self, attrs: Mapping[str, Any]) -> None:
        for key, gauge in self.intervals.items():
            if isinstance(value := attrs.get(key), (int, float)):
                gauge.set(value)
        reason = str(attrs.get("interval_reason", ""))
        self.interval_source.state(next((s for s in _SOURCES if reason.startswith(s)), "none"))

    def sample(self, sample: MemorySample) -> None:
        self._latest = sample  # one reference store: atomic, no lock needed

    def exposition(self) -> str:
        text: bytes = self._client.generate_latest(self.registry)
        return text.decode("utf-8")

    def collect(self) -> Iterator[Any]:
        """One gauge per figure of the latest memory sample that is present."""
        latest = self._latest
        if latest is None:
            return
        from prometheus_client.core import GaugeMetricFamily

        for key, text in _MEMORY_GAUGES.items():
            if (value := getattr(latest, key)) is not None:
                yield GaugeMetricFamily(f"{self._memory_prefix}{key}", text, value=value)

    def _stager_sum(self, field: str) -> float:
        stagers = [] if self._telemetry is None else self._telemetry.stagers()
        return float(sum(getattr(s.stats(), field) for s in stagers))


_SOURCES = ["auto", "interval_s", "measured", "none"]
