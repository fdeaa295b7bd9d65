"""Prometheus text exposition of checkpoint telemetry, in a registry of its own.

The metric names are listed in docs/telemetry.md. Every metric lives in the sink's own
``CollectorRegistry``, never the process-wide default, so two sinks never collide and nothing is
exported unasked. ``prometheus_client`` is an optional extra, imported only when a sink is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dcp_safe.errors import ConfigError
from dcp_safe.observe import Phase
from dcp_safe.telemetry.memory import MemorySample
from dcp_safe.telemetry.sinks import Event, EventKind, Sink

if TYPE_CHECKING:
    from dcp_safe.telemetry.recorder import Telemetry

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
    """Counters, gauges and histograms of saves, updated from events and samples.

    Args:
        telemetry: when given, the sink adds itself to it, and the budget gauges read its
            attached stagers at scrape time.

    Raises:
        ConfigError: ``prometheus_client`` is not installed.
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
        self.marks = {
            "skips": metric(counter, "skips", "Save requests skipped or coalesced away."),
            "fallbacks": metric(counter, "fallbacks", "Switches to synchronous saves."),
            "retries": metric(
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
        self.budget_envelope = metric(
            c.Gauge, "budget_envelope_bytes", "The staging budget's envelope."
        )
        self.budget_used = metric(
            c.Gauge, "budget_used_bytes", "Host bytes the staging pool holds."
        )
        self.budget_envelope.set_function(lambda: self._stager_sum("envelope_bytes"))
        self.budget_used.set_function(lambda: self._stager_sum("pool_bytes"))
        if telemetry is not None:
            telemetry.add_sink(self)

    # -- Sink -----------------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        if event.kind is EventKind.SPAN_START and event.name == Phase.SAVE.value:
            self.in_flight.inc()
        elif event.kind is EventKind.SPAN_END:
            self._span_end(event)
        elif event.kind is EventKind.MARK and event.name == "save_interval":
            self._interval(event.attrs)
        elif event.kind is EventKind.MARK:
            counter = self.marks.get(_MARK_COUNTERS.get(event.name, ""))
            if counter is not None:
                counter.inc()
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
        """The registry in Prometheus text format."""
        text: bytes = self._client.generate_latest(self.registry)
        return text.decode("utf-8")

    def collect(self) -> Iterator[Any]:
        """One gauge per figure of the latest memory sample that is present (at scrape time)."""
        latest = self._latest
        if latest is None:
            return
        from prometheus_client.core import GaugeMetricFamily

        for key, text in _MEMORY_GAUGES.items():
            value = getattr(latest, key)
            if value is not None:
                yield GaugeMetricFamily(f"{self._memory_prefix}{key}", text, value=value)

    def _stager_sum(self, field: str) -> float:
        stagers = [] if self._telemetry is None else self._telemetry.stagers()
        return float(sum(getattr(s.stats(), field) for s in stagers))


_SOURCES = ["auto", "interval_s", "measured", "none"]
_MARK_COUNTERS = {"skipped": "skips", "fallback": "fallbacks", "retry": "retries"}
