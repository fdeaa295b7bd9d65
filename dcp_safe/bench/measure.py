"""Measuring primitives shared by ``dcp-safe bench`` and the sweep in ``benchmarks/``.

The machines we measure on are shared, so every figure here is meant to be compared only with
figures taken in the same process run, with the contenders' order rotated from round to round
(:func:`rotate`), as medians (:func:`median`). What lives here:

* :func:`make_state`: a state dict of a given total size split into a given number of tensors;
* :class:`RssSampler`: a background thread sampling a process's RSS, whose peak can be
  taken and reset per save;
* :func:`describe_machine`: where a result was measured.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import psutil
import torch

from dcp_safe.periodic import Periodic

T = TypeVar("T")
MIB = 1 << 20
State = dict[str, Any]


def median(values: Iterable[float]) -> float:
    """The median of ``values`` (``nan`` when there are none)."""
    data = list(values)
    return statistics.median(data) if data else float("nan")


def rotate(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` rotated by ``round_index``: each contender goes first in turn."""
    if not items:
        return []
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])


def make_state(
    total_bytes: int, tensors: int = 8, *, compressible: bool = False, seed: int = 0
) -> State:
    """``tensors`` float32 tensors holding ``total_bytes`` together, plus a step and a dict.

    Args:
        total_bytes: tensor payload, split evenly (each tensor at least one element).
        tensors: how many tensors.
        compressible: small integers, about three quarters zero (quantized or sparse weights),
            which zstd shrinks several times over; otherwise normal random values.
        seed: the generator's seed.
    """
    gen = torch.Generator().manual_seed(seed)
    numel = max(1, total_bytes // 4 // max(1, tensors))
    state: State = {}
    for i in range(tensors):
        if compressible:
            t = torch.randint(0, 16, (numel,), generator=gen, dtype=torch.int32).float()
            t[t > 3] = 0
        else:
            t = torch.randn(numel, generator=gen)
        state[f"layers.{i:05d}.weight"] = t
    state["step"] = torch.tensor(100, dtype=torch.int64)
    state["extra"] = {"epoch": 3, "note": "dcp_safe.bench"}
    return state


def tensors_of(state: State) -> list[torch.Tensor]:
    """The top-level tensors of ``state``, in order."""
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def tensor_bytes(state: State) -> int:
    """Bytes of every top-level tensor of ``state``."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


class RssSampler:
    """Samples a process's RSS every ``interval_s`` on a thread; use as a context manager.

    The one RSS sampler of ``dcp-safe bench`` and ``benchmarks/``. :meth:`take_peak` returns
    the highest RSS since the previous call (or since start) and starts a new window, so one
    sampler serves a whole sequence of saves; the attributes below cover the whole run.

    Attributes (final after exit, which takes one last sample):
        baseline_bytes: RSS when sampling started.
        peak_bytes: the highest RSS seen.
        peak_delta_bytes: ``peak_bytes - baseline_bytes`` (never negative).

    Args:
        interval_s: seconds between samples.
        pid: the process to sample (e.g. a server child); this process when ``None``.
    """

    def __init__(self, interval_s: float = 0.005, pid: int | None = None) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process(pid)
        self._lock = threading.Lock()
        self._periodic: Periodic | None = None
        self._window_peak = 0
        self.baseline_bytes = 0
        self.peak_bytes = 0

    @property
    def peak_delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)

    def rss(self) -> int:
        """RSS now, also counted towards the peaks."""
        now = int(self._process.memory_info().rss)
        with self._lock:
            self._window_peak = max(self._window_peak, now)
            self.peak_bytes = max(self.peak_bytes, now)
        return now

    def take_peak(self) -> int:
        """The highest RSS seen in the current window; a new window starts at RSS now."""
        last = self.rss()
        with self._lock:
            peak, self._window_peak = self._window_peak, last
        return peak

    def start(self) -> RssSampler:
        """Take the baseline and start sampling."""
        self.baseline_bytes = self._window_peak = self.peak_bytes = self.rss()
        self._periodic = Periodic(self.rss, self.interval_s, name="bench-rss").start()
        return self

    def stop(self) -> int:
        """Stop sampling after one last sample; return :attr:`peak_bytes`."""
        if self._periodic is not None:
            self._periodic.stop()
        self.rss()
        return self.peak_bytes

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> dict[str, Any]:
    """CPU, memory, load, Python and torch versions of this machine, now."""
    memory = psutil.virtual_memory()
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_total_bytes": int(memory.total),
        "memory_available_bytes": int(memory.available),
        "load_average": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
