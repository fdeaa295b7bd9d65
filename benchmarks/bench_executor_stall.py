"""The process executor's stall against the thread executor's, saves interleaved in one process.

Usage::

    .venv/bin/python benchmarks/bench_executor_stall.py [--states 16x16MiB,10000x32KiB]
        [--rounds 10] [--dir D]

Issue #30's target: ``Runtime(executor="process")``'s stall (``save()`` on the
training thread: the copy into shared slabs) within 1.1x of ``executor="thread"``'s (the copy
into the stager's own pool, the copy floor). Per state (``COUNTxSIZE`` float32 tensors in one
flat dict) two managers on two folders, each warmed up with two committed saves (pools
allocated) and the worker ready; then per round one save on each, the order rotated, each
waited until committed before the next, so that neither copy runs beside the other's
background phase. A ``copy_floor`` row times one ``copy_`` of every tensor into a preallocated
copy. Medians over rounds; ratios against the thread executor's. Results:
``benchmarks/results/bench_executor_stall-<time>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    markdown_table,
    median,
    parse_state,
    rotate,
    run_and_report,
    write_results,
)

from dcp_safe import CheckpointManager, Runtime

RESULTS = Path(__file__).resolve().parent / "results"
EXECUTORS = ("thread", "process")


def measure(work: Path, label: str, count: int, size: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i:05d}": torch.randn(size // 4, generator=gen) for i in range(count)}
    stalls: dict[str, list[float]] = {e: [] for e in EXECUTORS}
    floor: list[float] = []
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    managers = {
        e: CheckpointManager(work / label / e, keep_last=1, runtime=Runtime(executor=e))
        for e in EXECUTORS
    }
    try:
        for manager in managers.values():
            for step in (1, 2):
                manager.save(step, state).committed.result(timeout=600)
            worker = manager._runner.worker  # until it is ready, saves run on a thread
            while worker is not None and not worker.ready:
                time.sleep(0.01)
        for round_ in range(rounds):
            for executor in rotate(list(EXECUTORS), round_):
                start = time.perf_counter()
                handle = managers[executor].save(10 + round_, state)
                stalls[executor].append(time.perf_counter() - start)
                handle.committed.result(timeout=600)
            start = time.perf_counter()
            for key, tensor in state.items():
                copies[key].copy_(tensor)
            floor.append(time.perf_counter() - start)
        fallbacks = {e: m.stats().fallback_reason for e, m in managers.items()}
    finally:
        for manager in managers.values():
            manager.close()
    med = {e: median(v) for e, v in stalls.items()} | {"copy_floor": median(floor)}
    return {
        "label": label,
        "tensors": count,
        "bytes": count * size,
        "median_s": med,
        "over_thread": {k: v / med["thread"] for k, v in med.items()},
        "stalls_s": stalls,
        "fallback_reason": fallbacks,  # a switch to synchronous saves would make it a sync save
        "rounds": rounds,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = [measure(work, text, *parse_state(text), args.rounds) for text in args.states]
    return {"machine": describe_machine(str(work)), "torch": torch.__version__, "rows": rows}


def report(results: dict[str, Any]) -> str:
    columns = (*EXECUTORS, "copy_floor")
    lines = []
    for row in results["rows"]:
        med, ratio = row["median_s"], row["over_thread"]
        lines.append([row["label"]] + [f"{1000 * med[c]:.1f} ({ratio[c]:.2f})" for c in columns])
    return markdown_table(["state", *(f"{c} ms (x thread)" for c in columns)], lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--states",
        type=lambda text: [s for s in text.split(",") if s and parse_state(s)],
        default=["16x16MiB", "10000x32KiB"],
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_executor_stall_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_executor_stall-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
