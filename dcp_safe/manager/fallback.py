"""When a manager should stop saving asynchronously: plain arithmetic, no torch, no threads.

The triggers and what to do after one are in docs/runbook.md, "Automatic fallback to
synchronous saves"; the precise rules (any one trips the monitor until
:meth:`FallbackMonitor.rearm`):

a. *Host memory*: a crossing is a move from at-or-above the reserve to below it; staying below
   is one crossing. The reading is the lowest since the previous request (``memory_watch``).
b. *Latency*: nearest-rank p99 of request-to-local-commit times. The interval is
   ``save_interval_s``, else the median gap between save requests (skipped ones included:
   they are the cadence asked for).
c. *Leaked buffers*: checked only at requests that find the slot free: the stager releases
   before the slot frees, so nothing legitimate is in use then.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from dcp_safe.errors import ConfigError

__all__ = ["FallbackMonitor", "FallbackOptions"]


@dataclass(frozen=True, kw_only=True)
class FallbackOptions:
    """Options of :class:`FallbackMonitor`.

    Args:
        memory_window_s: trigger (a)'s window.
        memory_crossings: crossings within the window that trip trigger (a).
        latency_window: completed saves trigger (b) looks at (the newest ones).
        min_completed: completions needed before trigger (b) may trip.
        interval_factor: trigger (b) trips when p99 > this many intervals.
        save_interval_s: the save interval; ``None`` measures it from save requests.

    Raises:
        ConfigError: a value out of range.
    """

    enabled: bool = True
    memory_window_s: float = 3600.0
    memory_crossings: int = 2
    latency_window: int = 20
    min_completed: int = 5
    interval_factor: float = 2.0
    save_interval_s: float | None = None

    def __post_init__(self) -> None:
        if not self.memory_window_s > 0 or not self.interval_factor > 0:
            raise ConfigError("memory_window_s and interval_factor must be > 0")
        if self.memory_crossings < 1 or self.latency_window < 1:
            raise ConfigError("memory_crossings and latency_window must be >= 1")
        if not 1 <= self.min_completed <= self.latency_window:
            raise ConfigError("min_completed must be in [1, latency_window]")
        if self.save_interval_s is not None and not self.save_interval_s > 0:
            raise ConfigError(f"save_interval_s must be > 0, got {self.save_interval_s!r}")


class FallbackMonitor:
    """Feed it observations; each ``on_*`` returns the reason when it trips, else ``None``.

    Args:
        reserve_bytes: the memory budget's reserve (trigger a).
    """

    def __init__(self, options: FallbackOptions, reserve_bytes: int) -> None:
        self.options = options
        self.reserve_bytes = reserve_bytes
        self.reason: str | None = None
        self._crossings: deque[float] = deque()
        self._below = False
        self._durations: deque[float] = deque(maxlen=options.latency_window)
        self._gaps: deque[float] = deque(maxlen=options.latency_window)
        self._last_request: float | None = None

    @property
    def tripped(self) -> bool:
        """Saves should be synchronous."""
        return self.reason is not None

    def on_request(self, now: float, available_bytes: int | None) -> str | None:
        """A save was requested at ``now`` with this much host memory available."""
        if self._last_request is not None:
            self._gaps.append(max(0.0, now - self._last_request))
        self._last_request = now
        if available_bytes is None:
            return None
        below = available_bytes < self.reserve_bytes
        crossed, self._below = below and not self._below, below
        if crossed:
            self._crossings.append(now)
        while self._crossings and now - self._crossings[0] > self.options.memory_window_s:
            self._crossings.popleft()
        if len(self._crossings) >= self.options.memory_crossings:
            return self.trip(
                f"host available memory fell below the reserve ({self.reserve_bytes} B)"
                f" {len(self._crossings)} times within {self.options.memory_window_s:g} s"
                f" (now {available_bytes} B)"
            )
        return None

    def on_completed(self, duration_s: float) -> str | None:
        """A save committed ``duration_s`` after it was requested."""
        self._durations.append(duration_s)
        interval = self.interval_s()
        if len(self._durations) < self.options.min_completed or interval is None:
            return None
        p99 = self.p99_s()
        limit = self.options.interval_factor * interval
        if p99 > limit:
            return self.trip(
                f"checkpoint completion p99 {p99:.3f} s over the last {len(self._durations)}"
                f" saves exceeds {self.options.interval_factor:g} save intervals"
                f" ({interval:.3f} s each)"
            )
        return None

    def on_idle(self, in_use_bytes: int) -> str | None:
        """No save is in flight, and the stager reports ``in_use_bytes`` leased."""
        if in_use_bytes > 0:
            return self.trip(
                f"staging buffers outlived their save: {in_use_bytes} B still in use with no"
                " save in flight"
            )
        return None

    def interval_s(self) -> float | None:
        """The configured interval, else the median measured gap (``None`` before two)."""
        if self.options.save_interval_s is not None:
            return self.options.save_interval_s
        return statistics.median(self._gaps) if self._gaps else None

    def p99_s(self) -> float:
        """Nearest-rank p99 of the completion times held (0 with none)."""
        if not self._durations:
            return 0.0
        ordered = sorted(self._durations)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    def rearm(self) -> None:
        """Back to asynchronous: forget the trip and the evidence that led to it."""
        self.reason = None
        self._crossings.clear()
        self._below = False
        self._durations.clear()

    def trip(self, reason: str) -> str | None:
        """Trip for ``reason`` (a trigger, or a peer rank that tripped); ``None`` if disabled or
        tripped already."""
        if not self.options.enabled or self.tripped:
            return None
        self.reason = reason
        return reason
