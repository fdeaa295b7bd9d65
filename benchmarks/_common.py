"""Timing, memory and reporting helpers shared by the benchmarks in this folder.

Every benchmark here runs its contenders in one process, alternates their order from round to
round and reports medians, because the machines we measure on are shared: a single run, or a
mean, says more about the neighbours than about the code. What lives here:

* :func:`median`, :func:`timed`, :func:`process_cpu_seconds` and :func:`rotate` for the
  measuring loop, and :class:`RssSampler`, a background thread that samples this process's RSS
  (or another process's, by pid) and reports the peak above the level it started from
  (``median``, ``rotate`` and ``RssSampler`` are :mod:`dcp_safe.bench.measure`'s, which the
  sweep and ``dcp-safe bench`` use too);
* :func:`markdown_table`, :func:`fmt_seconds`, :func:`fmt_rate` and
  :func:`~dcp_safe.units.format_size` (the package's spelling of a size) for reports;
* :func:`describe_machine` and :func:`write_results` so a JSON result says where it was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dcp_safe.bench.measure import RssSampler, median, rotate
from dcp_safe.units import format_size

__all__ = [
    "MIB",
    "RssSampler",
    "describe_machine",
    "describe_machine_line",
    "fmt_rate",
    "fmt_seconds",
    "format_size",
    "markdown_table",
    "median",
    "parse_state",
    "process_cpu_seconds",
    "rotate",
    "timed",
    "write_results",
]

T = TypeVar("T")

GIB = 1 << 30
MIB = 1 << 20
UNITS = {"KiB": 1 << 10, "MiB": MIB, "GiB": GIB}


def parse_state(text: str) -> tuple[int, int]:
    """A ``--states`` entry, ``COUNTxSIZE`` float32 tensors: ``"16x16MiB"`` -> (16, 16 MiB)."""
    found = re.fullmatch(r"(\d+)x(\d+)(KiB|MiB|GiB)", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"a state is COUNTxSIZE, e.g. 16x16MiB, not {text!r}")
    return int(found[1]), int(found[2]) * UNITS[found[3]]


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (wall seconds, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads together."""
    times = os.times()
    return times.user + times.system


def fmt_seconds(seconds: float) -> str:
    return f"{seconds:.3f} s"


def fmt_rate(nbytes: float, seconds: float) -> str:
    """Throughput in GB/s (10^9 bytes per second, as disk and hash vendors quote)."""
    if seconds <= 0:
        return "n/a"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; cells are rendered with ``str``."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _filesystem_of(path: str) -> dict[str, str]:
    """The mount (device, mount point, type) holding ``path``; empty when unknown."""
    real = os.path.realpath(path)
    best: Any = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > len(best.mountpoint)
        ):
            best = part
    if best is None:
        return {}
    return {"device": best.device, "mountpoint": best.mountpoint, "fstype": best.fstype}


def describe_machine(data_dir: str | None = None) -> dict[str, Any]:
    """CPU, memory, Python and library versions, and (optionally) the file system of a folder."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total_bytes": psutil.virtual_memory().total,
        "memory_available_bytes": psutil.virtual_memory().available,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    if data_dir is not None:
        info["data_dir"] = os.path.realpath(data_dir)
        info["data_fs"] = _filesystem_of(data_dir)
    return info


def describe_machine_line(info: dict[str, Any]) -> str:
    """One line for the top of a printed report."""
    fs = info.get("data_fs") or {}
    where = f", data on {fs.get('fstype', '?')} ({fs.get('device', '?')})" if fs else ""
    return (
        f"{info['cpu_model']}, {info['usable_cpus'] or info['logical_cpus']} CPUs, "
        f"{format_size(info['memory_total_bytes'])} RAM, Python {info['python']}, "
        f"torch {info['torch']}{where}"
    )


def write_results(path: str | os.PathLike[str], results: dict[str, Any]) -> Path:
    """Write ``results`` as indented JSON, creating the folder; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".writing")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out)
    return out


def run_and_report(
    prefix: str,
    scratch_parent: str | None,
    run: Callable[[Path], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
    save: Callable[[dict[str, Any]], Path],
) -> int:
    """A benchmark's main: run in a scratch folder (always removed), print the report, save."""
    import shutil
    import tempfile
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if scratch_parent is not None:
        Path(scratch_parent).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=scratch_parent))
    try:
        results = run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(report(results))
    print(f"\nresults: {save(results)}")
    return 0


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache, as after a restart (clean pages only:
    the benchmarks' saves fsync what they write)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
