"""torch_checkpointing on dcp_safe's storage against torch_checkpointing's own, in the same run.

Usage::

    .venv/bin/python benchmarks/bench_torch_checkpointing.py [--rounds 3] [--dir D] [--quick]

Two shapes of float32 state, saved as one torch_checkpointing item (``DefaultResharder``):
16 tensors of 64 MiB (1 GiB) and 4,096 tensors of 32 KiB (128 MiB). For each, one process
measures, alternating the order from round to round:

* *tc local*: ``LocalFileSystemStorageConfig(use_direct_io=False)``, torch_checkpointing's own
  storage (its direct I/O fails on close with EINVAL on this host's ext4: an unaligned last
  block), writing under ``tmp_`` and renaming, no fsync;
* *dcp_safe*: ``manager_config(root, save="sync")``: the same manager on a dcp_safe root, every
  file checksummed (xxh3-128) as it is written and fsynced, the manifest and marker last.

Each saves with the sync saver (after ``os.sync()``, so no contender pays for the previous
one's dirty pages), then loads twice: from storage (the files evicted from the page cache with
``posix_fadvise(DONTNEED)``, as after a restart) and again from the page cache; every byte is
verified on our side. Each round also measures the *durable floor*: the same tensor bytes written
to one file and fsynced (no format, checksum or commit), what any durable save of them costs on
this disk. Then the async saver's stall: how long ``mgr.save()`` holds the training thread,
median of three saves after a warm-up, for each storage.

Targets (issue 45): dcp_safe / tc local <= 1.15 on saves and <= 1.25 on loads, and the async
stall unchanged within noise. A third row, *dcp_safe no fsync*, runs ours with the files left
unsynced as torch_checkpointing's storage leaves them, to tell what durability costs from what
the checksums and the commit cost. Results go to
``benchmarks/results/bench_torch_checkpointing-<time>.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    MIB,
    describe_machine,
    evict,
    markdown_table,
    median,
    rotate,
    run_and_report,
    write_results,
)

import dcp_safe.torch_checkpointing as tc_module
from dcp_safe.torch_checkpointing import manager_config

SHAPES = {"16x64MiB": (16, 64 * MIB), "4096x32KiB": (4096, 32 * 1024)}
QUICK = {"16x4MiB": (16, 4 * MIB), "512x32KiB": (512, 32 * 1024)}
CONTENDERS = ("tc local", "dcp_safe", "dcp_safe no fsync")


def _items() -> dict[str, ItemSpec]:
    return {"model": ItemSpec(resharder=DefaultResharder())}


def _config(contender: str, root: Path, saver: str) -> CheckpointManager.Config:
    if contender.startswith("dcp_safe"):
        return manager_config(root, save=saver, items=_items())
    savers = {"sync": SyncCheckpointSaverConfig, "async": AsyncCheckpointSaverConfig}
    return CheckpointManager.Config(
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        save=savers[saver](),
        items=_items(),
    )


def _checkpoint_id(contender: str, root: Path, name: str) -> str:
    # dcp_safe's ids are names under its root; torch_checkpointing's own storage takes paths.
    return name if contender.startswith("dcp_safe") else str(root / name)


def _state(count: int, nbytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i:05d}": torch.rand(nbytes // 4, generator=gen) for i in range(count)}


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall seconds, and this process's CPU seconds (every thread, user and system): on a
    shared host the second says what the work costs whatever the neighbours do."""
    start, cpu = time.perf_counter(), _cpu()
    fn()
    return time.perf_counter() - start, _cpu() - cpu


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def _fsync(contender: str) -> Iterator[None]:
    """Ours without fsync, for the third row only: the module's backend opened unsynced."""
    if contender != "dcp_safe no fsync":
        yield
        return
    opened = tc_module.open_backend
    tc_module.open_backend = functools.partial(opened, fsync=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        tc_module.open_backend = opened  # type: ignore[assignment]


def _floor(root: Path, state: dict[str, torch.Tensor]) -> float:
    """Seconds to write the state's bytes to one new file and fsync it."""
    path = root / "floor.bin"
    os.sync()
    start = time.perf_counter()
    with path.open("wb") as f:
        for tensor in state.values():
            f.write(tensor.numpy().data)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - start
    path.unlink()
    return took


def _round(contender: str, root: Path, state: dict[str, torch.Tensor], n: int) -> dict[str, float]:
    name = f"step_{n:06d}"
    with _fsync(contender):
        mgr = CheckpointManager(_config(contender, root, "sync"))
    ckpt = _checkpoint_id(contender, root, name)
    into = {"model": {k: torch.empty_like(v) for k, v in state.items()}, "step": None}
    os.sync()
    try:
        with _fsync(contender):
            save = _timed(lambda: mgr.save(ckpt, {"model": state, "step": n}))
        evict(root)
        cold = _timed(lambda: mgr.load(ckpt, into=into))
        warm = _timed(lambda: mgr.load(ckpt, into=into))
    finally:
        mgr.close()
    loaded = into["model"]
    if not all(torch.equal(loaded[k], v) for k, v in state.items()):
        raise AssertionError(f"{contender}: a load differs from what was saved")
    figures = {"save": save, "load_evicted": cold, "load_warm": warm}
    return {f"{k}_{unit}": v[i] for k, v in figures.items() for i, unit in enumerate(("s", "cpu"))}


def _stall(contender: str, root: Path, state: dict[str, torch.Tensor]) -> float:
    """The median time ``save()`` holds the caller, over three async saves after a warm-up
    (each removed once written: one checkpoint on disk at a time)."""
    mgr = CheckpointManager(_config(contender, root, "async"))
    stalls = []
    try:
        for n in range(4):
            ckpt = _checkpoint_id(contender, root, f"async_{n:06d}")
            start = time.perf_counter()
            future = mgr.save(ckpt, {"model": state, "step": n})
            stalls.append(time.perf_counter() - start)
            if future is not None:
                future.result(timeout=600)
            shutil.rmtree(root / f"async_{n:06d}")
    finally:
        mgr.close()
    return median(stalls[1:])


def run(
    work: Path, shapes: dict[str, tuple[int, int]], rounds: int, *, stall: bool = True
) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": describe_machine(str(work)), "shapes": {}}
    for shape, (count, nbytes) in shapes.items():
        state = _state(count, nbytes)
        rows: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
        floor = []
        for r in range(rounds):
            (work / shape).mkdir(parents=True, exist_ok=True)
            floor.append(_floor(work / shape, state))
            for contender in rotate(list(CONTENDERS), r):
                root = work / shape / contender.replace(" ", "_")
                root.mkdir(parents=True, exist_ok=True)
                rows[contender].append(_round(contender, root, state, r))
                shutil.rmtree(root)
                print(f"{shape} round {r} {contender}: {rows[contender][-1]}", flush=True)
        figures = {
            c: {k: median([row[k] for row in rows[c]]) for k in rows[c][0]} for c in CONTENDERS
        }
        for contender in rotate(["tc local", "dcp_safe"], rounds) if stall else []:
            root = work / shape / f"async_{contender.replace(' ', '_')}"
            root.mkdir(parents=True, exist_ok=True)
            figures[contender]["async_stall_s"] = _stall(contender, root, state)
            shutil.rmtree(root)
        figures["durable floor"] = {"save_s": median(floor)}
        theirs = figures["tc local"]
        figures["ratio"] = {k: figures["dcp_safe"][k] / theirs[k] for k in figures["dcp_safe"]}
        unsynced = figures["dcp_safe no fsync"]
        figures["ratio_no_fsync"] = {k: unsynced[k] / theirs[k] for k in unsynced}
        results["shapes"][shape] = {"bytes": count * nbytes, "figures": figures}
    return results


def report(results: dict[str, Any]) -> str:
    headers = ["shape", "figure", "tc local", "dcp_safe", "ratio", "no fsync", "ratio"]
    headers += ["durable floor", "target"]
    targets = {"save_s": "<= 1.15", "load_evicted_s": "<= 1.25", "load_warm_s": "<= 1.25"}
    targets |= {key.replace("_s", "_cpu"): "(CPU seconds)" for key in list(targets)}
    rows = []
    for shape, entry in results["shapes"].items():
        figures = entry["figures"]
        for key, ratio in figures["ratio"].items():
            rows.append(
                [
                    shape,
                    key,
                    f"{figures['tc local'][key]:.3f} s",
                    f"{figures['dcp_safe'][key]:.3f} s",
                    f"{ratio:.2f}",
                    _or_dash(figures["dcp_safe no fsync"].get(key), " s"),
                    _or_dash(figures["ratio_no_fsync"].get(key), ""),
                    _or_dash(figures["durable floor"].get(key), " s"),
                    targets.get(key, "within noise"),
                ]
            )
    return markdown_table(headers, rows)


def _or_dash(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.3f}{unit}" if unit else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder's parent (default: /tmp)")
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    args = parser.parse_args()
    shapes = QUICK if args.quick else SHAPES
    return run_and_report(
        "bench_tc_",
        args.dir,
        lambda work: run(work, shapes, args.rounds),
        report,
        lambda results: write_results(
            Path(__file__).parent
            / "results"
            / f"bench_torch_checkpointing-{time.strftime('%Y%m%dT%H%M%S')}.json",
            results,
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
