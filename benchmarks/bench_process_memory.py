"""Host memory of the process executor: one staged generation plus the worker's fixed cost.

Usage::

    .venv/bin/python benchmarks/bench_process_memory.py [--states 16x16MiB,10000x32KiB]
        [--saves 4] [--dir D]

Issue #30's target: with ``Runtime(executor="process")`` the host holds at most one
staged generation plus the worker's fixed cost. Each contender runs in a fresh interpreter per
state (so neither sees the other's allocations): it builds the state (``COUNTxSIZE`` float32
tensors in one flat dict), notes its RSS, then saves ``--saves`` times, each waited until
committed, while a sampler records the training process's RSS every 5 ms. Reported:

* ``parent_peak``: the training process's peak RSS above the state (the staged generation: the
  stager's pool, or the shared slabs, which the worker maps without copying);
* ``worker_uss``: the worker's unique set after the last save (its interpreter, torch, and
  what DCP keeps per item; the slabs it maps are shared, not counted here);
* ``host``: their sum, against one generation (the state's bytes).

``thread`` runs the same saves with ``executor="thread"`` (no worker). Results:
``benchmarks/results/bench_process_memory-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    MIB,
    RssSampler,
    describe_machine,
    markdown_table,
    parse_state,
    run_and_report,
    write_results,
)

from dcp_safe import CheckpointManager, Runtime

RESULTS = Path(__file__).resolve().parent / "results"
EXECUTORS = ("thread", "process")


def child(executor: str, state_text: str, saves: int, root: str) -> dict[str, Any]:
    """One contender in this (fresh) interpreter."""
    count, size = parse_state(state_text)
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i:05d}": torch.randn(size // 4, generator=gen) for i in range(count)}
    worker_uss = 0
    with (
        RssSampler() as sampler,
        CheckpointManager(root, runtime=Runtime(executor=executor)) as manager,
    ):
        worker = manager._runner.worker
        if worker is not None:  # until it is ready, saves run on a thread: measure the worker's
            worker.start()
            while not worker.ready:
                time.sleep(0.01)
        for step in range(1, saves + 1):
            manager.save(step, state).committed.result(timeout=600)
        worker = manager._runner.worker
        if worker is not None and worker.pid is not None:
            worker_uss = int(psutil.Process(worker.pid).memory_full_info().uss)
    return {
        "parent_peak_bytes": sampler.peak_delta_bytes,
        "worker_uss_bytes": worker_uss,
        "state_bytes": count * size,
    }


def measure(work: Path, text: str, saves: int) -> dict[str, Any]:
    row: dict[str, Any] = {"label": text, "saves": saves}
    for executor in EXECUTORS:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                executor,
                text,
                str(saves),
                str(work / text / executor),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
        found["host_bytes"] = found["parent_peak_bytes"] + found["worker_uss_bytes"]
        found["host_over_generation"] = found["host_bytes"] / found["state_bytes"]
        row[executor] = found
    return row


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = [measure(work, text, args.saves) for text in args.states]
    return {"machine": describe_machine(str(work)), "torch": torch.__version__, "rows": rows}


def report(results: dict[str, Any]) -> str:
    lines = []
    for row in results["rows"]:
        for executor in EXECUTORS:
            r = row[executor]
            lines.append(
                [
                    row["label"],
                    executor,
                    f"{r['state_bytes'] / MIB:.0f}",
                    f"{r['parent_peak_bytes'] / MIB:.0f}",
                    f"{r['worker_uss_bytes'] / MIB:.0f}",
                    f"{r['host_bytes'] / MIB:.0f} ({r['host_over_generation']:.2f})",
                ]
            )
    headers = [
        "state",
        "executor",
        "generation (MiB)",
        "parent peak above state (MiB)",
        "worker USS (MiB)",
        "host (MiB, x generation)",
    ]
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        executor, state_text, saves, root = argv[1:5]
        print(json.dumps(child(executor, state_text, int(saves), root)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--states",
        type=lambda text: [s for s in text.split(",") if s and parse_state(s)],
        default=["16x16MiB", "10000x32KiB"],
    )
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_process_memory_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_process_memory-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
