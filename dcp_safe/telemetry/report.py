"""The save report: per-save phases, bytes, stall and memory; run-wide percentiles.

Built from recorded events and memory samples only (no live state), so it can also be rebuilt
from a JSON-lines file. Completion, stall, throughput and the peak over the pre-save band
(:data:`BAND_S` seconds) are defined in docs/telemetry.md, "The save report".
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_safe.observe import Phase
from dcp_safe.telemetry.memory import MemorySample, peak_of
from dcp_safe.telemetry.sinks import Event, EventKind

BAND_S = 1.0
_WIDE = 140


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100); ``None`` without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class SaveSummary:
    """One save, as this process saw it."""

    save: str
    step: int | None
    ok: bool
    error: str | None
    completion_s: float
    stall_s: float
    phases_s: dict[str, float] = field(default_factory=dict)
    bytes: int | None = None
    throughput_bytes_per_s: float | None = None
    peak_rss_over_band_bytes: int | None = None
    replicated: bool | None = None


@dataclass(frozen=True)
class TelemetryReport:
    """What :meth:`Telemetry.report` returns; :meth:`to_dict` and :meth:`print` render it."""

    saves: tuple[SaveSummary, ...]
    steps: int
    step_p50_s: float | None
    step_p99_s: float | None
    completion_p50_s: float | None
    completion_p99_s: float | None
    peak_rss_bytes: int | None
    peak_cgroup_bytes: int | None
    skipped: int
    fallbacks: int
    retries: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> Any:
        """The per-save table as a ``rich.table.Table``, the run-wide figures as its caption."""
        from rich.table import Table

        caption = (
            f"steps {self.steps}: p50 {_secs(self.step_p50_s)}, p99 {_secs(self.step_p99_s)}; "
            f"completion p50 {_secs(self.completion_p50_s)}, "
            f"p99 {_secs(self.completion_p99_s)}; peak RSS {_bytes(self.peak_rss_bytes)}; "
            f"skipped {self.skipped}, fallbacks {self.fallbacks}, retries {self.retries}"
        )
        table = Table(title="dcp_safe saves", caption=caption)
        for column in ("save", "ok", "stall", "completion", *_PHASES, "written", "GB/s", "peak+"):
            table.add_column(column, justify="left" if column == "save" else "right")
        for s in self.saves:
            gbps = s.throughput_bytes_per_s
            table.add_row(
                s.save,
                "yes" if s.ok else "NO",
                _secs(s.stall_s),
                _secs(s.completion_s),
                *(_secs(s.phases_s.get(p)) for p in _PHASES),
                _bytes(s.bytes),
                "-" if gbps is None else f"{gbps / 1e9:.2f}",
                _bytes(s.peak_rss_over_band_bytes),
            )
        return table

    def print(self, console: Any = None) -> None:
        """Print :meth:`table` (to ``console``, a ``rich.console.Console``, or stdout)."""
        from rich.console import Console

        if console is None:  # a pipe or a log file gets room for every column
            console = Console() if sys.stdout.isatty() else Console(width=_WIDE)
        console.print(self.table())


_PHASES = tuple(
    p.value for p in Phase if p not in (Phase.SAVE, Phase.STATE_DICT, Phase.REPLICATION)
)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}MiB"


def build_report(events: Sequence[Event], samples: Sequence[MemorySample]) -> TelemetryReport:
    """Summarize ``events`` and ``samples`` (see the module docstring for definitions)."""
    ends = [e for e in events if e.kind is EventKind.SPAN_END]
    saves = tuple(
        _summarize(root, ends, samples)
        for root in ends
        if root.name == Phase.SAVE.value and root.save is not None
    )
    steps = [e.duration_s for e in events if e.kind is EventKind.STEP and e.duration_s is not None]
    completions = [s.completion_s for s in saves if s.ok]
    marks = [e.name for e in events if e.kind is EventKind.MARK]
    return TelemetryReport(
        saves=saves,
        steps=len(steps),
        step_p50_s=percentile(steps, 50),
        step_p99_s=percentile(steps, 99),
        completion_p50_s=percentile(completions, 50),
        completion_p99_s=percentile(completions, 99),
        peak_rss_bytes=peak_of(samples, "rss_bytes"),
        peak_cgroup_bytes=peak_of(samples, "cgroup_current_bytes"),
        skipped=marks.count("skipped"),
        fallbacks=marks.count("fallback"),
        retries=marks.count("retry"),
    )


def _summarize(root: Event, ends: Sequence[Event], samples: Sequence[MemorySample]) -> SaveSummary:
    duration = root.duration_s or 0.0
    start = root.t - duration
    mine = [e for e in ends if e.save == root.save and e is not root and e.t >= start]
    phases: dict[str, float] = {}
    for e in mine:
        phases[e.name] = phases.get(e.name, 0.0) + (e.duration_s or 0.0)
    writes = [e for e in mine if e.name == Phase.WRITE.value]
    nbytes = sum(e.bytes or 0 for e in writes) if writes else None
    write_s = sum(e.duration_s or 0.0 for e in writes)
    staging = [e.t for e in mine if e.name == Phase.STAGING.value]
    replication = [e.ok for e in mine if e.name == Phase.REPLICATION.value]
    return SaveSummary(
        save=root.save or "",
        step=root.step,
        ok=bool(root.ok),
        error=root.error,
        completion_s=duration,
        stall_s=(min(staging) - start) if staging else duration,
        phases_s=phases,
        bytes=nbytes,
        throughput_bytes_per_s=nbytes / write_s if nbytes and write_s > 0 else None,
        peak_rss_over_band_bytes=_over_band(samples, start, root.t),
        replicated=bool(replication[-1]) if replication else None,
    )


def _over_band(samples: Sequence[MemorySample], start: float, end: float) -> int | None:
    before = [s for s in samples if s.t < start]
    band = [s for s in before if s.t >= start - BAND_S] or before[-1:]
    during = [s for s in samples if start <= s.t <= end]
    base, peak = peak_of(band, "rss_bytes"), peak_of(during, "rss_bytes")
    return None if base is None or peak is None else max(0, peak - base)
