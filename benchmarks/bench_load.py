"""Loads and per-item cost: dcp_safe against torch's FileSystemWriter/FileSystemReader.

Usage::

    .venv/bin/python benchmarks/bench_load.py [--rounds 3] [--sizes-mib 512,1024,4096]
        [--counts 4096,10000] [--count-size-mib 128] [--dir D]

Two families of float32 state, each measured in one process:

* *sizes*: 32 tensors holding 512 MiB, 1 GiB, 4 GiB (restart time after a failure is a few
  large loads);
* *counts*: 4,096 and 10,000 tensors holding 128 MiB together (a sharded model with optimizer
  state holds thousands of tensors per rank; the per-item cost dominates).

For each state: one checkpoint written by each writer (``SafeStorageWriter``, fsync on, and
``FileSystemWriter(sync_files=True)``), then ``--rounds`` rounds, the contenders' order rotated
per round, of ``dcp.save`` into a fresh folder (durable, time to return) and ``dcp.load`` into
preallocated tensors (``SafeStorageReader`` verifies every item; ``FileSystemReader`` checks
nothing), every load checked for exact values. Loads read from the page cache (the files were
just written), which is the worst case for verification: nothing else to wait for. Medians;
ratios dcp_safe / torch. Results: ``benchmarks/results/bench_load-<time>.json``.

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
from _common import describe_machine, markdown_table, median, rotate, run_and_report, write_results

from dcp_safe import SafeStorageReader, SafeStorageWriter

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
SIZE_TENSORS = 32
TARGETS = {"sizes": {"load": 0.8}, "counts": {"save": 0.5, "load": 0.5}}

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
            lambda: dcp.save(state, storage_writer=writer, checkpoint_id=folder.name, no_dist=True)
        )
    writer = FileSystemWriter(folder, sync_files=True)
    return _timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))


def _load(contender: str, state: State, target: State, folder: Path) -> float:
    for tensor in target.values():
        tensor.zero_()
    if contender == "dcp_safe":
        reader: Any = SafeStorageReader(folder.parent)
        seconds = _timed(
            lambda: dcp.load(target, storage_reader=reader, checkpoint_id=folder.name, no_dist=True)
        )
    else:
        reader = FileSystemReader(folder)
        seconds = _timed(lambda: dcp.load(target, storage_reader=reader, no_dist=True))
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError(f"{contender}: the load differs from the save")
    return seconds


def measure(work: Path, family: str, label: str, state: State, rounds: int) -> dict[str, Any]:
    contenders = ["dcp_safe", "torch"]
    target = {k: torch.empty_like(v) for k, v in state.items()}
    kept = {c: work / c / "kept" for c in contenders}
    for contender in contenders:  # the checkpoints every round loads; warms imports and caches
        _save(contender, state, kept[contender])
        _load(contender, state, target, kept[contender])
    times: dict[str, dict[str, list[float]]] = {c: {"save": [], "load": []} for c in contenders}
    for round_ in range(rounds):
        for contender in rotate(contenders, round_):
            fresh = work / contender / f"r{round_}"
            times[contender]["save"].append(_save(contender, state, fresh))
            shutil.rmtree(fresh, ignore_errors=True)
            times[contender]["load"].append(_load(contender, state, target, kept[contender]))
    for contender in contenders:
        shutil.rmtree(work / contender, ignore_errors=True)
    med = {c: {part: median(v) for part, v in parts.items()} for c, parts in times.items()}
    ratios = {part: med["dcp_safe"][part] / med["torch"][part] for part in ("save", "load")}
    return {
        "family": family,
        "label": label,
        "tensors": len(state),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "median_s": med,
        "dcp_safe_over_torch": ratios,
        "rounds": rounds,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = []
    for size in args.sizes:
        state = make_state(size * MIB, SIZE_TENSORS)
        rows.append(measure(work, "sizes", f"{size} MiB in {SIZE_TENSORS}", state, args.rounds))
        del state
    for count in args.counts:
        state = make_state(args.count_size_mib * MIB, count)
        label = f"{count:,} tensors, {args.count_size_mib} MiB"
        rows.append(measure(work, "counts", label, state, args.rounds))
        del state
    return {"machine": describe_machine(str(work)), "torch": torch.__version__, "rows": rows}


def report(results: dict[str, Any]) -> str:
    lines = []
    for r in results["rows"]:
        m, x = r["median_s"], r["dcp_safe_over_torch"]
        cells = [r["label"]]
        for part in ("save", "load"):
            limit = TARGETS[r["family"]].get(part)
            verdict = "" if limit is None else (" met" if x[part] <= limit else " **missed**")
            target = "" if limit is None else f" (target <= {limit}:{verdict})"
            cells += [
                f"{m['dcp_safe'][part]:.3f} / {m['torch'][part]:.3f}",
                f"{x[part]:.2f}{target}",
            ]
        lines.append(cells)
    headers = [
        "state",
        "save s dcp_safe / torch",
        "save ratio",
        "load s dcp_safe (verified) / torch",
        "load ratio",
    ]
    return markdown_table(headers, lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender")
    parser.add_argument("--sizes-mib", dest="sizes", type=_ints, default=[512, 1024, 4096])
    parser.add_argument("--counts", type=_ints, default=[4096, 10000])
    parser.add_argument("--count-size-mib", type=int, default=128)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
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
