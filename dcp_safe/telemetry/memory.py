"""``MemorySampler``: a background thread that samples memory fast during saves, slowly otherwise.

A save's memory cost is a short spike: a slow sampler misses it, and a fast one running all the
time costs CPU for nothing. Busy marks are counted, so nested saves work. The fields, the rates
and why PSS/USS are read only while idle: docs/telemetry.md, "The memory sampler".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

from dcp_safe.choices import require_int, seconds
from dcp_safe.errors import ConfigError
from dcp_safe.host_memory import find_cgroup_files
from dcp_safe.periodic import Periodic

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

    ``proc_root`` and ``cgroup_root`` are mount points (tests point them at a fake tree). PSS and
    USS are read only while idle, at most every ``pss_interval_s`` (``None``: never).
    ``on_sample`` is called with each sample, on the sampler's thread. An interval that is not
    positive and finite, or ``max_samples < 1``, is a ConfigError.
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
        self.busy_interval_s = seconds("busy_interval_s", busy_interval_s)
        self.idle_interval_s = seconds("idle_interval_s", idle_interval_s)
        require_int("max_samples", max_samples, 1)
        self._reader = ProcReader(proc_root, cgroup_root)
        self.pss_interval_s = pss_interval_s
        self._last_rollup = -math.inf  # when PSS/USS were last read (monotonic)
        self._pinned, self._in_flight, self._on_sample = pinned_bytes, saves_in_flight, on_sample
        self._clock = clock or anchored_clock()
        self._samples: deque[MemorySample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._busy = 0
        self._periodic: Periodic | None = None

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

    def mark_busy(self) -> None:
        """Sample at ``busy_interval_s`` until the matching :meth:`mark_idle`."""
        with self._lock:
            self._busy += 1
            periodic = self._periodic
        if periodic is not None:  # woken early when a save starts, so its first ms are sampled
            periodic.wake()

    def mark_idle(self) -> None:
        with self._lock:
            self._busy = max(0, self._busy - 1)

    @contextmanager
    def busy(self) -> Iterator[MemorySampler]:
        self.mark_busy()
        try:
            yield self
        finally:
            self.mark_idle()

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
        now = time.monotonic()
        interval = self.pss_interval_s
        if interval is None or self._busy or now - self._last_rollup < interval:
            return False
        self._last_rollup = now
        return True

    def samples(self) -> list[MemorySample]:
        with self._lock:
            return list(self._samples)

    def peak(self, field: str) -> int | None:
        """The largest value of ``field`` (a ConfigError unless a :class:`MemorySample` figure)
        over the samples kept (``None`` if never present)."""
        if field not in FIELDS:
            raise ConfigError(f"unknown sample field {field!r}; one of {', '.join(FIELDS)}")
        return peak_of(self.samples(), field)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._samples)

    def _interval_s(self) -> float:
        # Read without the lock: Periodic calls this under its own, and mark_busy wakes it.
        return self.busy_interval_s if self._busy else self.idle_interval_s


# -- reading the figures ------------------------------------------------------------------------
# From ``/proc`` and the cgroup files (where those are is :mod:`dcp_safe.host_memory`'s to say),
# each one optional: a parser returns nothing for what it cannot read, never raises. ``/proc``
# rather than psutil, because ``memory_full_info`` walks every mapping in ``smaps`` where
# ``smaps_rollup`` is the kernel's own summary; psutil is the fallback for RSS where there is no
# ``/proc`` (macOS).

_KIB = 1024
_READ_BYTES = 1 << 16  # every file read here is a few KiB


def _picker(*keys: str) -> re.Pattern[str]:
    return re.compile(rf"^({'|'.join(keys)}):?\s+(\d+)", re.MULTILINE)


# One regex per file, over the whole text: the sampler runs every 20 ms during a save, and
# splitting every line of vmstat (~180 of them) in Python costs more than reading it.
_STATUS = _picker("VmRSS", "VmLck")
_ROLLUP = _picker("Pss", "Private_Clean", "Private_Dirty")
_MEMINFO = _picker("MemAvailable")
_VMSTAT = _picker("pswpin", "pswpout")


def _int(text: str | None) -> int | None:
    try:
        return int((text or "").split()[0])
    except (ValueError, IndexError):  # "max", empty
        return None


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


class ProcReader:
    """Reads this process's and the host's memory figures under ``proc_root``.

    Files are kept open and re-read with ``pread`` at offset 0: a third of the CPU of reopening
    (measured: 0.05 vs 0.16 ms for four ``/proc`` files), which matters every 20 ms.
    """

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.proc_root = proc_root
        self._self = os.path.join(proc_root, "self")
        self.cgroup = find_cgroup_files(proc_root, cgroup_root)
        self._psutil_fallback = proc_root == "/proc" and not os.path.isdir(self._self)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def read(self, *, rollup: bool = True) -> dict[str, int | None]:
        """Every figure now; ``None`` for those this host does not expose. ``rollup``: also PSS
        and USS, from ``smaps_rollup``, which is costly and stalls a save's page faults."""
        status = self._pick("self/status", _STATUS, _KIB)
        rollup_fields = self._pick("self/smaps_rollup", _ROLLUP, _KIB) if rollup else {}
        meminfo = self._pick("meminfo", _MEMINFO, _KIB)
        vmstat = self._pick("vmstat", _VMSTAT)
        private = [rollup_fields.get(k) for k in ("Private_Clean", "Private_Dirty")]
        # The command name may hold spaces; the 10th field after it is majflt.
        stat = (self._read(os.path.join(self._self, "stat")) or "").rpartition(")")[2].split()
        return {
            "rss_bytes": status.get("VmRSS", self._rss_fallback()),
            "pss_bytes": rollup_fields.get("Pss"),
            "uss_bytes": None if None in private else sum(p or 0 for p in private),
            "cgroup_current_bytes": _int(self._read(self.cgroup.current)),
            "cgroup_peak_bytes": _int(self._read(self.cgroup.peak)),
            "host_available_bytes": meminfo.get("MemAvailable"),
            "swap_in_pages": vmstat.get("pswpin"),
            "swap_out_pages": vmstat.get("pswpout"),
            "major_faults": _int(stat[9]) if len(stat) > 9 else None,
            "locked_bytes": status.get("VmLck"),
        }

    def _pick(self, name: str, pattern: re.Pattern[str], unit: int = 1) -> dict[str, int]:
        text = self._read(os.path.join(self.proc_root, name)) or ""
        return {key: int(value) * unit for key, value in pattern.findall(text)}

    def _read(self, path: str | None) -> str | None:
        if path is None:
            return None
        try:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, _READ_BYTES, 0).decode("ascii", errors="replace")
        except OSError:  # missing, unreadable, or gone: absent now, tried again next time
            return None

    def _rss_fallback(self) -> int | None:
        if not self._psutil_fallback:
            return None
        import psutil

        return int(psutil.Process().memory_info().rss)
