"""Loads and per-item cost: dcp_safe against torch's FileSystemWriter/FileSystemReader.

Usage::

    .venv/bin/python benchmarks/bench_load.py [--rounds 3] [--sizes-mib 512,1024,4096]
        [--counts 4096,10000] [--count-size-mib 128 | --count-tensor-kib 32]
        [--cache warm,evicted] [--dir D]

Two families of float32 state, each measured in one process:

* *sizes*: 32 tensors holding 512 MiB, 1 GiB, 4 GiB (restart time after a failure is a few
  large loads);
* *counts*: 4,096 and 10,000 tensors holding 128 MiB together, or ``--count-tensor-kib`` each
  (a sharded model with optimizer state holds thousands of tensors per rank; the per-item cost
  dominates).

For each state: one checkpoint written by each writer (``SafeStorageWriter``, fsync on, and
``FileSystemWriter(sync_files=True)``), then ``--rounds`` rounds, the contenders' order rotated
per round, of a save into a fresh folder (durable, time to return) and a load into
preallocated tensors, every load checked for exact values. ``dcp_safe`` is what a user calls:
``dcp_safe.save`` / ``dcp_safe.load`` (``SafeSavePlanner``: divergence fingerprints and audit
sums; ``SafeStorageReader`` verifies every item); ``torch`` is ``dcp.save`` / ``dcp.load`` with
DCP's default planners (``FileSystemReader`` checks nothing). The untimed first save makes
every timed one a second or later save of the same structure in this process, which is what a
training job repeats. ``--cache`` picks how loads find the files: ``warm`` (just written, in
the page cache: the worst case for verification, nothing else to wait for) and ``evicted``
(every file dropped with ``posix_fadvise(DONTNEED)`` first, as after a restart; they were
fsynced, so the pages are clean and do go). Medians; ratios dcp_safe / torch. Results:
``benchmarks/results/bench_load-<time>.json``.

Targets (issue 18): verified load <= 0.8x torch's reader at 512 MiB, 1 GiB and 4 GiB; at 4,096
and 10,000 tensors, save <= 0.5x torch's writer and load <= 0.5x its reader.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    evict,
    markdown_table,
    median,
    rotate,
    run_and_report,
    write_results,
)

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
SIZE_TENSORS = 32
TARGETS = {"sizes": {"load": 0.8}, "counts": {"save": 0.5, "load": 0.5}}
CACHE_STATES = ("warm", "evicted")

State = dict[str, torch.Tensor]


def make_state(total_bytes: int, count: int) -> State:
    gen = torch.Generator().manual_seed(0)
    numel = max(1, total_bytes // 4 // count)
    return {f"layers.{i:05d}.weight": torch.randn(numel, generator=gen) for i in range(count)}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _save(contender: str, state: State, folder: Path) -> float:
    if contender == "dcp_safe":
        writer: Any = SafeStorageWriter(folder.parent)
        return _timed(
            lambda: dcp_safe.save(
                state, storage_writer=writer, checkpoint_id=folder.name, no_dist=True
            )
        )
    writer = FileSystemWriter(folder, sync_files=True)
    return _timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))


def _load(contender: str, state: State, target: State, folder: Path, cache: str = "warm") -> float:
    for tensor in target.values():
        tensor.zero_()
    if cache == "evicted":
        evict(folder)
    if contender == "dcp_safe":
        reader: Any = SafeStorageReader(folder.parent)
        seconds = _timed(
            lambda: dcp_safe.load(
                target, storage_reader=reader, checkpoint_id=folder.name, no_dist=True
            )
        )
    else:
        reader = FileSystemReader(folder)
        seconds = _timed(lambda: dcp.load(target, storage_reader=reader, no_dist=True))
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError(f"{contender}: the load differs from the save")
    return seconds


def measure(
    work: Path,
    family: str,
    label: str,
    state: State,
    rounds: int,
    caches: tuple[str, ...] = ("warm",),
) -> dict[str, Any]:
    contenders = ["dcp_safe", "torch"]
    target = {k: torch.empty_like(v) for k, v in state.items()}
    kept = {c: work / c / "kept" for c in contenders}
    for contender in contenders:  # the checkpoints every round loads; warms imports and caches
        _save(contender, state, kept[contender])
        _load(contender, state, target, kept[contender])
    parts = ["save", *(_load_part(cache) for cache in caches)]
    times = {c: {part: [] for part in parts} for c in contenders}
    for round_ in range(rounds):
        for contender in rotate(contenders, round_):
            fresh = work / contender / f"r{round_}"
            times[contender]["save"].append(_save(contender, state, fresh))
            shutil.rmtree(fresh, ignore_errors=True)
            for cache in caches:
                seconds = _load(contender, state, target, kept[contender], cache)
                times[contender][_load_part(cache)].append(seconds)
    for contender in contenders:
        shutil.rmtree(work / contender, ignore_errors=True)
    med = {c: {part: median(v) for part, v in parts.items()} for c, parts in times.items()}
    ratios = {part: med["dcp_safe"][part] / med["torch"][part] for part in parts}
    return {
        "family": family,
        "label": label,
        "tensors": len(state),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "median_s": med,
        "dcp_safe_over_torch": ratios,
        "rounds": rounds,
    }


def _load_part(cache: str) -> str:
    return "load" if cache == "warm" else f"load_{cache}"


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = []
    caches = tuple(args.cache)
    for size in args.sizes:
        state = make_state(size * MIB, SIZE_TENSORS)
        label = f"{size} MiB in {SIZE_TENSORS}"
        rows.append(measure(work, "sizes", label, state, args.rounds, caches))
        del state
    for count in args.counts:
        if args.count_tensor_kib:
            state = make_state(count * args.count_tensor_kib * 1024, count)
            label = f"{count:,} x {args.count_tensor_kib} KiB"
        else:
            state = make_state(args.count_size_mib * MIB, count)
            label = f"{count:,} tensors, {args.count_size_mib} MiB"
        rows.append(measure(work, "counts", label, state, args.rounds, caches))
        del state
    return {"machine": describe_machine(str(work)), "torch": torch.__version__, "rows": rows}


def report(results: dict[str, Any]) -> str:
    lines = []
    parts = [p for p in results["rows"][0]["median_s"]["torch"]] if results["rows"] else []
    for r in results["rows"]:
        m, x = r["median_s"], r["dcp_safe_over_torch"]
        cells = [r["label"]]
        for part in parts:
            limit = TARGETS[r["family"]].get(part.partition("_")[0])
            verdict = "" if limit is None else (" met" if x[part] <= limit else " **missed**")
            target = "" if limit is None else f" (target <= {limit}:{verdict})"
            cells += [
                f"{m['dcp_safe'][part]:.3f} / {m['torch'][part]:.3f}",
                f"{x[part]:.2f}{target}",
            ]
        lines.append(cells)
    headers = ["state"]
    for part in parts:
        what = part.replace("_", " (") + ")" if "_" in part else part
        headers += [f"{what} s dcp_safe / torch", f"{what} ratio"]
    return markdown_table(headers, lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender")
    parser.add_argument("--sizes-mib", dest="sizes", type=_ints, default=[512, 1024, 4096])
    parser.add_argument("--counts", type=_ints, default=[4096, 10000])
    parser.add_argument("--count-size-mib", type=int, default=128)
    parser.add_argument(
        "--count-tensor-kib", type=int, default=0, help="each counted tensor's size (not a total)"
    )
    parser.add_argument(
        "--cache",
        type=lambda text: [c for c in text.split(",") if c],
        default=list(CACHE_STATES),
        help="page-cache states of the loads: warm, evicted or both",
    )
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    if not set(args.cache) <= set(CACHE_STATES) or not args.cache:
        parser.error(f"--cache takes {', '.join(CACHE_STATES)}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_load_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_load-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
