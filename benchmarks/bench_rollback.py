"""Rollback from host memory against a restore from storage, for the same committed step.

Usage::

    .venv/bin/python benchmarks/bench_rollback.py [--states 16x16MiB,10000x32KiB] [--rounds 3]
        [--dir D]

Per state (``COUNTxSIZE`` float32 tensors in one flat dict), in one process: a
``CheckpointManager(root, resume=Resume(keep_in_memory=True))`` saves and commits step 1; then,
per round, the live tensors are overwritten (as three more training steps would) and brought
back to step 1 three ways, each checked exactly against the committed values:

* ``rollback``: ``manager.rollback(state)``: the kept staged copy, checked against the
  committed manifest's checksums, copied into the live tensors; no storage read;
* ``restore_warm``: ``manager.restore(state)`` with the checkpoint's files in the page cache;
* ``restore_evicted``: the same after ``posix_fadvise(DONTNEED)`` on every file of the root.

Also the floor: one ``copy_`` of every kept tensor into its live one (what a rollback that
checked nothing would cost). Medians over rounds; ratios against ``restore_warm``. Results:
``benchmarks/results/bench_rollback-<time>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    evict,
    markdown_table,
    median,
    parse_state,
    rotate,
    run_and_report,
    write_results,
)

from dcp_safe import CheckpointManager, Resume

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDERS = ("rollback", "restore_warm", "restore_evicted", "copy_floor")


def make_state(count: int, size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i:05d}": torch.randn(size // 4, generator=gen) for i in range(count)}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(work: Path, label: str, count: int, size: int, rounds: int) -> dict[str, Any]:
    state = make_state(count, size)
    committed = {k: v.clone() for k, v in state.items()}
    root = work / label
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    with CheckpointManager(root, resume=Resume(keep_in_memory=True)) as manager:
        handle = manager.save(1, state)
        assert handle is not None
        handle.committed.result(timeout=600)
        kept = manager.stager.kept()
        assert kept is not None
        runs: dict[str, Callable[[], object]] = {
            "rollback": lambda: manager.rollback(state),
            "restore_warm": lambda: manager.restore(state),
            "restore_evicted": lambda: manager.restore(state),
            "copy_floor": lambda: [state[k].copy_(kept[1][k]) for k in state],
        }
        for round_ in range(rounds):
            for contender in rotate(list(CONTENDERS), round_):
                for tensor in state.values():
                    tensor.fill_(float(round_ + 2))  # training moved on
                if contender == "restore_evicted":
                    evict(root)
                times[contender].append(_timed(runs[contender]))
                if not all(torch.equal(state[k], v) for k, v in committed.items()):
                    raise AssertionError(f"{contender} did not bring back step 1 exactly")
    med = {c: median(v) for c, v in times.items()}
    return {
        "label": label,
        "tensors": count,
        "bytes": count * size,
        "median_s": med,
        "over_restore_warm": {c: med[c] / med["restore_warm"] for c in CONTENDERS},
        "rounds": rounds,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = [measure(work, text, *parse_state(text), args.rounds) for text in args.states]
    return {"machine": describe_machine(str(work)), "torch": torch.__version__, "rows": rows}


def report(results: dict[str, Any]) -> str:
    lines = []
    for row in results["rows"]:
        med, ratio = row["median_s"], row["over_restore_warm"]
        lines.append([row["label"]] + [f"{med[c]:.3f} ({ratio[c]:.2f})" for c in CONTENDERS])
    headers = ["state", *(f"{c} s (x restore_warm)" for c in CONTENDERS)]
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--states",
        type=lambda text: [s for s in text.split(",") if s and parse_state(s)],
        default=["16x16MiB", "10000x32KiB"],
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_rollback_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_rollback-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
