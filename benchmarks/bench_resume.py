"""What exact resume costs: fingerprints at save, and the audit of a restore.

Usage::

    .venv/bin/python benchmarks/bench_resume.py [--rounds 3] [--dir D] [--gib 1]

Two shapes of float32 state: 16 tensors making ``--gib`` GiB (few large tensors: bytes
dominate) and 10,000 tensors of 32 KiB (320 MiB: per-tensor work dominates). For each, in one
process, alternating the order from round to round, medians reported:

* **save**: ``dcp_safe.save`` to a local root (fsync'd, as every dcp_safe save) with
  ``SafeSavePlanner(check_divergence=False, record_audit=False)`` (DCP's planning alone: the
  baseline), with divergence fingerprints only (xxh3-64 of every plain tensor: what a
  replicated model costs each rank), and with both (the default: fingerprints and the audit's
  block sums). Target (issue 27): fingerprinting 1 GiB of replicated tensors adds <= 5 %.
* **restore**: ``dcp_safe.load`` from the warm page cache with and without ``audit=True``.
  Target: the audit adds <= 10 %.

A single process stands for each rank: every rank fingerprints its own state in parallel, and
the coordinator's comparison of a few integers a tensor is noise beside it. Results go to
``benchmarks/results/bench_resume-<time>.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    GIB,
    describe_machine,
    describe_machine_line,
    fmt_seconds,
    markdown_table,
    median,
    rotate,
    run_and_report,
    write_results,
)

import dcp_safe
from dcp_safe import SafeLoadPlanner, SafeSavePlanner, SafeStorageReader, SafeStorageWriter

SAVE_CONTENDERS = {
    "DCP planning (baseline)": {"check_divergence": False, "record_audit": False},
    "+ divergence fingerprints": {"check_divergence": True, "record_audit": False},
    "+ audit block sums (default)": {"check_divergence": True, "record_audit": True},
}


def _shapes(gib: float) -> dict[str, dict[str, torch.Tensor]]:
    big = int(gib * GIB) // 16 // 4
    return {
        f"16 x {big * 4 >> 20} MiB": {f"w{i:02d}": torch.randn(big) for i in range(16)},
        "10,000 x 32 KiB": {f"p{i:05d}": torch.randn(8192) for i in range(10_000)},
    }


def _save(root: Path, name: str, state: dict[str, Any], options: dict[str, bool]) -> float:
    started = time.perf_counter()
    dcp_safe.save(
        state,
        checkpoint_id=name,
        storage_writer=SafeStorageWriter(root),
        planner=SafeSavePlanner(**options),
    )
    return time.perf_counter() - started


def _load(root: Path, name: str, state: dict[str, Any], audit: bool) -> float:
    target = {k: torch.empty_like(v) for k, v in state.items()}
    started = time.perf_counter()
    dcp_safe.load(
        target,
        checkpoint_id=name,
        storage_reader=SafeStorageReader(root),
        planner=SafeLoadPlanner(),
        audit=audit,
    )
    return time.perf_counter() - started


def run(rounds: int, base: Path, gib: float) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": describe_machine(str(base)), "shapes": {}}
    for shape, state in _shapes(gib).items():
        saves: dict[str, list[float]] = {k: [] for k in SAVE_CONTENDERS}
        loads: dict[str, list[float]] = {"restore": [], "restore + audit": []}
        for round_ in range(rounds):
            for contender in rotate(list(SAVE_CONTENDERS), round_):
                root = base / f"save-{round_}-{len(saves[contender])}"
                saves[contender].append(_save(root, "s", state, SAVE_CONTENDERS[contender]))
                shutil.rmtree(root)
            root = base / "load"
            if not root.exists():
                _save(root, "s", state, SAVE_CONTENDERS["+ audit block sums (default)"])
                _load(root, "s", state, audit=False)  # warm the page cache
            for contender in rotate(list(loads), round_):
                loads[contender].append(_load(root, "s", state, contender.endswith("audit")))
        shutil.rmtree(base / "load")
        results["shapes"][shape] = {
            "save_s": {k: median(v) for k, v in saves.items()},
            "load_s": {k: median(v) for k, v in loads.items()},
        }
    return results


def report(results: dict[str, Any]) -> str:
    lines = [describe_machine_line(results["machine"]), ""]
    for shape, data in results["shapes"].items():
        base = data["save_s"]["DCP planning (baseline)"]
        rows = [(name, fmt_seconds(t), f"{t / base:.3f}x") for name, t in data["save_s"].items()]
        lines += [f"save, {shape}", markdown_table(("planner", "median", "vs baseline"), rows)]
        plain = data["load_s"]["restore"]
        rows = [(name, fmt_seconds(t), f"{t / plain:.3f}x") for name, t in data["load_s"].items()]
        lines += ["", f"restore, {shape} (warm cache)"]
        lines += [markdown_table(("load", "median", "vs restore"), rows), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="scratch parent (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(__file__).parent / "results" / f"bench_resume-{stamp}.json"
    return run_and_report(
        "bench_resume-",
        args.dir,
        lambda work: run(args.rounds, work, args.gib),
        report,
        lambda results: write_results(out, results),
    )


if __name__ == "__main__":
    sys.exit(main())
