"""The demo's report: what ``dcp-safe demo`` measured, and how it is shown.

It owns the report's shape (:class:`DemoReport`, one :class:`SaveRecord` per save) and its
rendering: a rich table of per-save stalls and commit times, then plain summary lines (stall,
memory, committed cuts, the restore check, where things are). :mod:`dcp_safe.demo` fills the
report in; keeping the text here means the run reads as a run, and the summary can be produced
(and tested) from a report alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dcp_safe import layout
from dcp_safe.checkpoints.catalog import CheckpointInfo
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manager import ManagerStats
from dcp_safe.staging import MemoryBudget
from dcp_safe.units import format_size


@dataclass
class SaveRecord:
    """One checkpoint the demo asked for.

    Attributes:
        step: the training step.
        name: the checkpoint name.
        sync_s: training stall of a synchronous save of the same state (same disk).
        async_stall_s: training stall of the async save: call to staged.
        local_commit_s: call to committed and verified locally (None until known).
        remote: ``"committed"`` after ``remote_commit_s``, ``"skipped"`` (a newer save was
            replicated instead), or the error.
        remote_commit_s: call to committed on the remote tier.
    """

    step: int
    name: str
    sync_s: float
    async_stall_s: float = 0.0
    local_commit_s: float | None = None
    remote: str = "pending"
    remote_commit_s: float | None = None


@dataclass
class DemoReport:
    """Everything the demo measured, and where it put things."""

    root: str
    remote: str
    remote_note: str
    saves: list[SaveRecord] = field(default_factory=list)
    bytes_per_save: int = 0
    budget: MemoryBudget | None = None
    pool_peak_bytes: int = 0
    rss_before_bytes: int = 0
    rss_peak_bytes: int = 0
    host_available_min_bytes: int = 0
    memory_source: str = ""
    executor: str = ""
    stats: ManagerStats | None = None
    local: list[CheckpointInfo] = field(default_factory=list)
    remote_checkpoints: list[CheckpointInfo] = field(default_factory=list)
    restored: str = ""
    restored_tensors: int = 0
    restore_ok: bool = False
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0


def raise_if_failed(report: DemoReport) -> None:
    """Raise when the restore check failed (the CLI turns this into exit status 1).

    Raises:
        CheckpointCorruptError: the restored state differs from the live one.
    """
    if not report.restore_ok:
        raise CheckpointCorruptError(
            report.remote,
            f"state restored from {report.restored} differs from the live state",
            item=", ".join(report.mismatches[:5]),
        )


def render(report: DemoReport, console: Any) -> None:
    """Print the summary on a rich ``console``: per-save stalls, memory, cuts, restore, paths."""
    from rich.table import Table

    table = Table(
        title="Training stall per checkpoint: synchronous vs async (same state, same run)"
    )
    for column in ("step", "sync save", "async stall", "sync/async", "local commit", "S3 commit"):
        table.add_column(column, justify="right")
    for r in report.saves:
        table.add_row(
            str(r.step),
            _ms(r.sync_s),
            _ms(r.async_stall_s),
            f"{r.sync_s / r.async_stall_s:.1f}x" if r.async_stall_s > 0 else "-",
            _ms(r.local_commit_s),
            _ms(r.remote_commit_s) if r.remote == "committed" else r.remote,
        )
    console.print(table)
    for line in summary_lines(report):
        console.print(line, highlight=False, markup=False)


def summary_lines(report: DemoReport) -> list[str]:
    """The summary below the table, as plain lines."""
    return [
        *_stall_lines(report),
        *_memory_lines(report),
        *_cut_lines(report),
        *_restore_lines(report),
        *_where_lines(report),
    ]


def _stall_lines(report: DemoReport) -> list[str]:
    done = [r for r in report.saves if r.async_stall_s > 0]
    if not done:
        return ["no async save was started"]
    sync = _upper_median([r.sync_s for r in done])
    stall = _upper_median([r.async_stall_s for r in done])
    return [
        f"state per save: {format_size(report.bytes_per_save)} (model + AdamW state)",
        f"training stall, median of {len(done)} saves: {_ms(stall)} async"
        f" vs {_ms(sync)} for a synchronous save ({_ratio(stall, sync)})",
    ]


def _ratio(stall: float, sync: float) -> str:
    """How the async stall compares with the synchronous save, in words that fit the ratio."""
    if stall < sync:
        return f"{sync / stall:.1f}x less"
    if stall > sync:
        return f"{stall / sync:.1f}x more"
    return "the same"


def _memory_lines(report: DemoReport) -> list[str]:
    lines = [
        f"host memory ({report.memory_source}): RSS {format_size(report.rss_before_bytes)} before"
        f" training, peak {format_size(report.rss_peak_bytes)}"
        f" (+{format_size(report.rss_peak_bytes - report.rss_before_bytes)}; includes the"
        " synchronous baseline saves, upload buffers and, without --remote, the S3 server's"
        " stored objects)",
    ]
    if report.executor == "process":
        ran = 0 if report.stats is None else report.stats.worker_saves
        lines.append(
            f"{ran} of {len(report.saves)} saves' writes, commits and uploads ran in one"
            " checkpoint worker process (executor='process'; its memory is not in the RSS"
            " above): the first save started it without waiting for it, and until it was"
            " ready (an interpreter importing torch, at a lower priority) saves ran on a"
            " thread of this process"
        )
    elif report.executor:
        lines.append("the saves' writes ran on a thread of this process (executor='thread')")
    if report.budget is not None:
        envelope = report.budget.envelope_bytes
        share = report.pool_peak_bytes / envelope if envelope else float("inf")
        lines.append(
            f"staging pool peak {format_size(report.pool_peak_bytes)} (reused across saves) ="
            f" {share:.2%} of the staging budget: {report.budget.explain()}"
        )
        lines.append(
            f"host MemAvailable never fell below {format_size(report.host_available_min_bytes)}"
            f" (the budget's reserve: {format_size(report.budget.reserve)})"
        )
    return lines


def _cut_lines(report: DemoReport) -> list[str]:
    stats = report.stats
    requested = report.saves[-1].step if report.saves else None
    lines = [f"requested cut: step {requested}"]
    for tier, found in (("local", report.local), ("S3", report.remote_checkpoints)):
        newest = found[-1] if found else None
        cut = f"step {newest.step} ({newest.name})" if newest else "none"
        kept = ", ".join(i.name for i in found) or "-"
        lines.append(f"committed cut {tier:5s}: {cut}; kept by retention (keep_last=2): {kept}")
    if stats is not None:
        lines.append(
            f"saves: {stats.requested} requested, {stats.committed} committed,"
            f" {stats.skipped} skipped, {stats.failed} failed, {stats.pruned} pruned locally,"
            f" {stats.sync_saves} synchronous (fallback: {stats.fallback_reason or 'none'})"
        )
    return lines


def _restore_lines(report: DemoReport) -> list[str]:
    if report.restore_ok:
        verdict = f"PASSED: all {report.restored_tensors} tensors and the step number identical"
    else:
        verdict = f"FAILED: differs at {', '.join(report.mismatches[:5])}"
    return [f"restore of {report.restored} from S3 alone: {verdict}"]


def _where_lines(report: DemoReport) -> list[str]:
    return [
        f"local root: {report.root} (kept; try: dcp-safe ls {report.root})",
        f"S3 replica: {report.remote} ({report.remote_note})",
        f"history: {os.path.join(report.root, layout.HISTORY_FILE)}",
        f"demo finished in {report.seconds:.1f} s",
    ]


def _upper_median(values: list[float]) -> float:
    """The middle value; of the two middle ones, the larger (no averaging of two saves)."""
    return sorted(values)[len(values) // 2]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"
