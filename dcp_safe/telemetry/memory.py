"""``MemorySampler``: a background thread that samples memory fast during saves, slowly otherwise.

A save's memory cost is a short spike: a slow sampler misses it, and a fast one running all the
time costs CPU for nothing. Busy marks are counted, so nested saves work. The fields, the rates
and why PSS/USS are read only while idle: docs/telemetry.md, "The memory sampler".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

from dcp_safe.errors import ConfigError
from dcp_safe.periodic import Periodic
from dcp_safe.telemetry.sources import ProcReader

__all__ = ["MemorySample", "MemorySampler", "anchored_clock", "peak_of"]

log = logging.getLogger(__name__)


def anchored_clock() -> Callable[[], float]:
    """A clock in epoch seconds that never goes back: wall time once, then ``perf_counter``."""
    wall0, mono0 = time.time(), time.perf_counter()
    return lambda: wall0 + (time.perf_counter() - mono0)


@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """One sample: ``t`` in epoch seconds (the sampler's clock); every other figure is ``None``
    where this host does not expose it (docs/telemetry.md, "The memory sampler", lists them)."""

    t: float
    rss_bytes: int | None = None
    pss_bytes: int | None = None
    uss_bytes: int | None = None
    cgroup_current_bytes: int | None = None
    cgroup_peak_bytes: int | None = None
    host_available_bytes: int | None = None
    swap_in_pages: int | None = None
    swap_out_pages: int | None = None
    major_faults: int | None = None
    locked_bytes: int | None = None
    pinned_bytes: int | None = None
    saves_in_flight: int | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


FIELDS = tuple(f.name for f in fields(MemorySample) if f.name != "t")


def peak_of(samples: Iterable[MemorySample], field: str) -> int | None:
    """The largest ``field`` over ``samples`` (``None`` if never present)."""
    return max((v for s in samples if (v := getattr(s, field)) is not None), default=None)


class MemorySampler:
    """Samples memory on a background thread; a context manager, or :meth:`start`/:meth:`stop`.

    Args:
        proc_root, cgroup_root: mount points (tests point them at a fake tree).
        pss_interval_s: the shortest interval between PSS/USS reads, which happen only while
            idle; ``None`` never reads them.
        pinned_bytes: returns the staging pool's pinned bytes (e.g. from ``stager.stats()``).
        saves_in_flight: returns the number of saves in flight.
        on_sample: called with each sample, on the sampler's thread.
        clock: epoch seconds (default: :func:`anchored_clock`).

    Raises:
        ConfigError: an interval that is not positive, or ``max_samples < 1``.
    """

    def __init__(
        self,
        *,
        busy_interval_s: float = 0.02,
        idle_interval_s: float = 1.0,
        proc_root: str = "/proc",
        cgroup_root: str = "/sys/fs/cgroup",
        pss_interval_s: float | None = 10.0,
        pinned_bytes: Callable[[], int | None] | None = None,
        saves_in_flight: Callable[[], int | None] | None = None,
        on_sample: Callable[[MemorySample], None] | None = None,
        max_samples: int = 100_000,
        clock: Callable[[], float] | None = None,
    ) -> None:
        for name, value in (
            ("busy_interval_s", busy_interval_s),
            ("idle_interval_s", idle_interval_s),
        ):
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if max_samples < 1:
            raise ConfigError(f"max_samples must be >= 1, got {max_samples!r}")
        self.busy_interval_s = float(busy_interval_s)
        self.idle_interval_s = float(idle_interval_s)
        self._reader = ProcReader(proc_root, cgroup_root)
        self.pss_interval_s = pss_interval_s
        self._last_rollup: float | None = None
        self._pinned = pinned_bytes
        self._in_flight = saves_in_flight
        self._on_sample = on_sample
        self._clock = clock or anchored_clock()
        self._samples: deque[MemorySample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._busy = 0
        self._periodic: Periodic | None = None

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> MemorySampler:
        """Take a first sample now and start the thread (no-op when running)."""
        with self._lock:
            if self._periodic is not None:
                return self
            self._periodic = periodic = Periodic(
                self.sample_now, self._interval_s, name="dcp_safe-memory"
            )
        self.sample_now()
        periodic.start()
        return self

    def stop(self) -> None:
        """Stop the thread after one last sample (no-op when stopped)."""
        with self._lock:
            periodic, self._periodic = self._periodic, None
        if periodic is not None:
            periodic.stop()
            self.sample_now()

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- rate -----------------------------------------------------------------------------------

    def mark_busy(self) -> None:
        """Sample at ``busy_interval_s`` until the matching :meth:`mark_idle`."""
        with self._lock:
            self._busy += 1
            periodic = self._periodic
        if periodic is not None:  # woken early when a save starts, so its first ms are sampled
            periodic.wake()

    def mark_idle(self) -> None:
        """Undo one :meth:`mark_busy`."""
        with self._lock:
            self._busy = max(0, self._busy - 1)

    @contextmanager
    def busy(self) -> Iterator[MemorySampler]:
        """Sample fast inside the block."""
        self.mark_busy()
        try:
            yield self
        finally:
            self.mark_idle()

    @property
    def is_busy(self) -> bool:
        with self._lock:
            return self._busy > 0

    # -- samples --------------------------------------------------------------------------------

    def sample_now(self) -> MemorySample:
        """Take one sample on this thread, keep it, and return it."""
        figures = self._reader.read(rollup=self._rollup_due())
        sample = MemorySample(
            t=self._clock(),
            pinned_bytes=self._pinned() if self._pinned is not None else None,
            saves_in_flight=self._in_flight() if self._in_flight is not None else None,
            **figures,
        )
        with self._lock:
            self._samples.append(sample)
        if self._on_sample is not None:
            try:
                self._on_sample(sample)
            except Exception:  # a broken sink must not stop sampling; it is logged, not hidden
                log.exception("dcp_safe: a memory-sample consumer failed")
        return sample

    def _rollup_due(self) -> bool:
        if self.pss_interval_s is None or self.is_busy:
            return False
        now = time.monotonic()
        if self._last_rollup is not None and now - self._last_rollup < self.pss_interval_s:
            return False
        self._last_rollup = now
        return True

    def samples(self) -> list[MemorySample]:
        """The samples kept, oldest first."""
        with self._lock:
            return list(self._samples)

    def peak(self, field: str) -> int | None:
        """The largest value of ``field`` over the samples kept (``None`` if never present).

        Raises:
            ConfigError: ``field`` is not a :class:`MemorySample` figure.
        """
        if field not in FIELDS:
            raise ConfigError(f"unknown sample field {field!r}; one of {', '.join(FIELDS)}")
        return peak_of(self.samples(), field)

    @property
    def count(self) -> int:
        """Samples taken and kept so far."""
        with self._lock:
            return len(self._samples)

    def _interval_s(self) -> float:
        # Read without the lock: Periodic calls this under its own, and mark_busy wakes it.
        return self.busy_interval_s if self._busy else self.idle_interval_s
