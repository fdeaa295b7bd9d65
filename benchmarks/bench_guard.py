"""The mutation guard's cost, as a fraction of the copy it guards.

Usage::

    .venv/bin/python benchmarks/bench_guard.py [--rounds 15] [--dir D]

Two shapes of state, each float32: 16 tensors of 16 MiB (256 MiB; few large tensors, where the
bytes dominate) and 10,000 tensors of 32 KiB (320 MiB; a many-tensor model, where per-tensor
work dominates). For each, one process measures, alternating the order from round to round:

* *copy floor*: a bare ``copy_`` of every tensor into preallocated buffers (what any stager
  must spend);
* *staging, guard on / off*: ``BudgetedStager.stage(state).result()`` with a warmed pool, with
  ``mutation_guard=True`` (the default) and ``False``;
* *guard*: the guard's own work on the same tensors, timed alone: reading every version counter
  and data pointer at the request, comparing each pointer before its copy, and comparing the
  counters after (``SnapshotGuard`` and ``changed``), with no copy in between.

The target (docs/benchmarks.md) is guard / copy floor <= 2 % at both shapes. The on-off
difference of whole stagings is reported too, but on a shared 2-core machine it swings by more
than the guard costs; the direct measure is the figure to quote. Results go to
``benchmarks/results/bench_guard-<time>.json``.
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
    rotate,
    run_and_report,
    write_results,
)

from dcp_safe.staging import BudgetedStager
from dcp_safe.staging._tree import collect_tensors
from dcp_safe.staging.guard import SnapshotGuard

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"16 x 16 MiB": (16, 4 << 20), "10,000 x 32 KiB": (10_000, 8 << 10)}


def make_state(count: int, numel: int) -> dict[str, Any]:
    return {f"layers.{i}.weight": torch.randn(numel) for i in range(count)}


def copy_floor(sources: list[torch.Tensor], buffers: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for src, dst in zip(sources, buffers, strict=True):
            dst.copy_(src)
    return time.perf_counter() - start


def guard_alone(sources: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    guard = SnapshotGuard(sources)
    for src, data_ptr in zip(sources, guard.data_ptrs, strict=True):  # as before each copy
        if src.data_ptr() != data_ptr:
            raise AssertionError("a storage moved")
    if guard.changed():
        raise AssertionError("nothing updated the state, yet the guard saw a change")
    return time.perf_counter() - start


def staging(stager: BudgetedStager, state: dict[str, Any]) -> float:
    start = time.perf_counter()
    staged = stager.stage(state).result()
    elapsed = time.perf_counter() - start
    del staged
    time.sleep(0.05)  # the dropped dict's release runs on the staging thread
    return elapsed


def measure(name: str, count: int, numel: int, rounds: int) -> dict[str, Any]:
    state = make_state(count, numel)
    sources = collect_tensors(state)
    buffers = [torch.empty_like(t) for t in sources]
    on, off = BudgetedStager(), BudgetedStager(mutation_guard=False)
    times: dict[str, list[float]] = {"floor": [], "guard": [], "on": [], "off": []}
    try:
        staging(on, state), staging(off, state), copy_floor(sources, buffers)  # warm up
        contenders = {
            "floor": lambda: copy_floor(sources, buffers),
            "guard": lambda: guard_alone(sources),
            "on": lambda: staging(on, state),
            "off": lambda: staging(off, state),
        }
        for round_ in range(rounds):
            for key in rotate(list(contenders), round_):
                times[key].append(contenders[key]())
    finally:
        on.close()
        off.close()
    med = {key: median(values) for key, values in times.items()}
    per_round = [g / f for g, f in zip(times["guard"], times["floor"], strict=True)]
    return {
        "shape": name,
        "tensors": count,
        "bytes": count * numel * 4,
        "median_s": med,
        "guard_over_floor": med["guard"] / med["floor"],
        "guard_over_floor_per_round_median": median(per_round),
        "guard_over_staging": med["guard"] / med["off"],
        "on_over_off": med["on"] / med["off"],
        "guard_per_tensor_us": med["guard"] / count * 1e6,
        "rounds": rounds,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    del work  # nothing touches storage
    rows = [measure(name, c, n, args.rounds) for name, (c, n) in SHAPES.items()]
    return {"machine": describe_machine(), "torch": torch.__version__, "shapes": rows}


def report(results: dict[str, Any]) -> str:
    rows = []
    for r in results["shapes"]:
        m = r["median_s"]
        rows.append(
            [
                r["shape"],
                f"{m['floor'] * 1e3:.1f} ms",
                f"{m['off'] * 1e3:.1f} ms",
                f"{m['guard'] * 1e3:.2f} ms ({r['guard_per_tensor_us']:.2f} µs/tensor)",
                f"{r['guard_over_floor']:.2%}",
                f"{r['guard_over_staging']:.2%}",
                f"{r['on_over_off']:.3f}",
            ]
        )
    headers = [
        "state",
        "copy floor",
        "staging (guard off)",
        "guard alone",
        "guard / floor",
        "guard / staging",
        "staging on / off",
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per contender")
    parser.add_argument("--dir", default=None, help="scratch folder (nothing is written)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_guard_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_guard-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
