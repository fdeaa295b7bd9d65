"""When a manager should stop saving asynchronously: plain arithmetic, no torch, no threads.

The triggers and what to do after one are in docs/runbook.md, "Automatic fallback to
synchronous saves"; the precise rules (any one trips the monitor until
:meth:`FallbackMonitor.rearm`):

a. *Host memory*: a crossing is a move from at-or-above the reserve to below it; staying below
   is one crossing. The reading is the lowest since the previous request (:class:`MemoryWatch`).
b. *Latency*: nearest-rank p99 of request-to-local-commit times. The interval is
   ``save_interval_s``, else the median gap between save requests (skipped ones included:
   they are the cadence asked for).
c. *Leaked buffers*: checked only at requests that find the slot free: the stager releases
   before the slot frees, so nothing legitimate is in use then.

:class:`FallbackMonitor` is that arithmetic; :class:`FallbackSwitch` feeds it and acts on it.
The memory signal is sampled every second (:class:`MemoryWatch`): sampled only at save requests
it would see the node between saves, when staging holds least, and miss the dips a save causes.
The ``fallback`` history event is recorded when the *agreed* decision first says so, not when
this rank's monitor trips: latencies trip each rank at its own moment, and the record must be
the same on every rank.
"""

from __future__ import annotations

import logging
import statistics
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dcp_safe.errors import ConfigError
from dcp_safe.host_memory import available_bytes_now
from dcp_safe.manager.handles import SaveHandle
from dcp_safe.manager.ledger import Ledger
from dcp_safe.periodic import Periodic
from dcp_safe.telemetry.report import percentile

log = logging.getLogger("dcp_safe.manager")


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

    A value out of range raises a ConfigError.
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
    ``reserve_bytes``: the memory budget's reserve (trigger a)."""

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
        return self.reason is not None

    def on_request(self, now: float, available_bytes: int | None) -> str | None:
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
        self._durations.append(duration_s)
        interval = self.interval_s()
        if len(self._durations) < self.options.min_completed or interval is None:
            return None
        p99 = percentile(self._durations, 99) or 0.0  # nearest-rank
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
        if in_use_bytes <= 0:
            return None
        return self.trip(
            f"staging buffers outlived their save: {in_use_bytes} B still in use with no"
            " save in flight"
        )

    def interval_s(self) -> float | None:  # else the median measured gap (None before two)
        median = statistics.median(self._gaps) if self._gaps else None
        return self.options.save_interval_s or median

    def rearm(self) -> None:
        """Back to asynchronous: forget the trip and the evidence that led to it."""
        self.reason, self._below = None, False
        self._crossings.clear()
        self._durations.clear()

    def trip(self, reason: str) -> str | None:
        """Trip for ``reason`` (a trigger, or a peer rank that tripped); ``None`` if disabled or
        tripped already."""
        if not self.options.enabled or self.tripped:
            return None
        self.reason = reason
        return reason


class MemoryWatch:
    """A background sampler of available memory (a daemon thread)."""

    def __init__(
        self, sample: Callable[[], int] = available_bytes_now, interval_s: float = 1.0
    ) -> None:
        self._sample, self._lock = sample, threading.Lock()
        self._lowest: int | None = None
        self._periodic = Periodic(self._tick, interval_s, name="dcp_safe-fallback-watch").start()

    def lowest(self) -> int | None:
        """The lowest reading since the last call (``None``: the host does not say)."""
        with self._lock:
            lowest, self._lowest = self._lowest, None
        return _least(lowest, self._read())

    def close(self) -> None:  # idempotent
        self._periodic.stop(timeout_s=5)

    def _tick(self) -> None:
        reading = self._read()
        with self._lock:
            self._lowest = _least(self._lowest, reading)

    def _read(self) -> int | None:
        try:
            return int(self._sample())
        except (OSError, ValueError) as exc:  # a host that stops saying is not an error
            log.debug("dcp_safe: reading available memory failed: %s", exc)
            return None


def _least(*readings: int | None) -> int | None:
    return min((r for r in readings if r is not None), default=None)


@dataclass(eq=False)
class FallbackSwitch:
    """Feeds a :class:`FallbackMonitor` and acts on its verdicts (``sample_memory``: the host's
    available bytes now, ``None`` when unknown)."""

    monitor: FallbackMonitor
    sample_memory: Callable[[], int | None]
    clock: Callable[[], float]
    ledger: Ledger  # its condition guards the monitor (not thread-safe by itself)
    _announced: bool = field(default=False, init=False)  # the agreed fallback is in the record
    # For the latencies (trigger b): a request's time, until its handle is gone.
    _requested_at: weakref.WeakKeyDictionary[SaveHandle, float] = field(
        default_factory=weakref.WeakKeyDictionary, init=False
    )

    @property
    def reason(self) -> str | None:
        with self.ledger.cond:
            return self.monitor.reason

    def on_request(self, handle: SaveHandle, leaked_bytes: Callable[[], int]) -> str | None:
        """Feed a save request; the reason this rank saves synchronously (``None``: it does not).
        ``leaked_bytes`` is called only when no other trigger fired."""
        now = self.clock()
        available = self.sample_memory()
        with self.ledger.cond:
            self._requested_at[handle] = now
            reason = self.monitor.on_request(now, available)
        in_use = leaked_bytes() if reason is None else 0
        with self.ledger.cond:
            reason = reason or self.monitor.on_idle(in_use)
            current = self.monitor.reason
        if reason is not None:
            self._switched(handle, reason)
        return current

    def follow(self, handle: SaveHandle, agreed: str | None) -> None:
        """Act on the agreed decision of a request: switch too when the ranks fall back
        because of a peer, and record the fallback once, at the same request on every rank."""
        with self.ledger.cond:
            if agreed is None:
                self._announced = False
                return
            reason = self.monitor.trip(f"peers fell back: {agreed}")  # None: tripped already
            first, self._announced = not self._announced, True
        if reason is not None:
            self._switched(handle, reason)
        if first:
            self.ledger.record("fallback", handle, reason=agreed)

    def on_committed(self, handle: SaveHandle, *, counted: bool = True) -> None:
        """Feed the completion latency of a committed save, unless not ``counted``: one that
        ran on a thread while the checkpoint worker started shares the host with its imports
        and carries the first save's one-time costs; the steady state is what is judged."""
        with self.ledger.cond:
            requested_at = self._requested_at.pop(handle, None)
            if requested_at is None or not counted:
                return
            reason = self.monitor.on_completed(self.clock() - requested_at)
        if reason is not None:
            self._switched(handle, reason)

    def rearm(self) -> None:
        with self.ledger.cond:
            was = self.monitor.reason
            self.monitor.rearm()
        if was is not None:
            log.info("dcp_safe: asynchronous checkpoints re-armed (fell back: %s)", was)
            self.ledger.record("rearmed", (None, None), reason=f"was: {was}")

    def _switched(self, handle: SaveHandle, reason: str) -> None:
        log.warning("dcp_safe: falling back to synchronous checkpoints: %s", reason)
        self.ledger.mark("fallback", handle, reason=reason)
