"""A new manager's first and second save: the default executor against ``executor="thread"``.

Usage::

    .venv/bin/python benchmarks/bench_first_saves.py [--state 8x8MiB] [--rounds 3]
        [--gap-s 1.0] [--hogs 0] [--dir D]

Issue #43, finding 2: the save requested while the first save started the checkpoint worker
carried its start-up (an interpreter importing torch: seconds, tens of seconds loaded). Per
round and executor (the order rotated) a fresh manager on a fresh folder (``when_busy="wait"``)
saves a state (``COUNTxSIZE`` float32 tensors), trains for ``--gap-s`` (matrix products on this
process's threads), saves again, and waits for both commits. Per save: the *stall* (``save()``
on the training thread) and the *commit latency* (request to ``committed``), which executor ran
it (the worker or a thread), and for the default executor when its worker was ready (from the
first request). ``--hogs N`` loads the host with N busy-looping processes for the whole run.
Medians over rounds. Results: ``benchmarks/results/bench_first_saves-<time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import threading
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
from dcp_safe.errors import DrainTimeoutError

RESULTS = Path(__file__).resolve().parent / "results"
EXECUTORS = ("auto", "thread")


def _hog(parent: int) -> None:
    while os.getppid() == parent:  # gone with the benchmark, however it ends
        for _ in range(1_000_000):
            pass


def _train(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _trial(root: Path, executor: str, state: dict[str, Any], gap_s: float) -> dict[str, Any]:
    manager = CheckpointManager(
        root, when_busy="wait", keep_last=2, runtime=Runtime(executor=executor)
    )
    worker = manager._runner.worker  # the default executor's (None: a thread only)
    ready_at: list[float] = []
    stop = threading.Event()
    try:
        saves = []
        requested = time.perf_counter()
        for step in (1, 2):
            before = manager.stats().worker_saves
            start = time.perf_counter()
            handle = manager.save(step, state)
            assert handle is not None
            stall = time.perf_counter() - start
            # Counted as it starts, inside save(): the path this one took.
            save = {"stall_s": stall, "in_worker": manager.stats().worker_saves > before}
            handle.committed.add_done_callback(
                lambda _, t=start, d=save: d.update(commit_s=time.perf_counter() - t)
            )
            saves.append(save)
            if step == 1 and worker is not None:

                def watch() -> None:
                    while not stop.is_set() and not worker.ready:
                        time.sleep(0.01)
                    if worker.ready:
                        ready_at.append(time.perf_counter() - requested)

                threading.Thread(target=watch, daemon=True).start()
            if step == 1:
                _train(gap_s)
        manager.wait(600)
        stats = manager.stats()
        result = {
            "saves": saves,
            "worker_saves": stats.worker_saves,
            "sync_saves": stats.sync_saves,
            "fallback": stats.fallback_reason,
        }
    finally:
        stop.set()
        # A worker still starting (under load: minutes at its lower priority) is killed here.
        with contextlib.suppress(DrainTimeoutError):
            manager.close(timeout_s=5)
    result["worker_ready_s"] = ready_at[0] if ready_at else None
    return result


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    count, size = parse_state(args.state)
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i:05d}": torch.randn(size // 4, generator=gen) for i in range(count)}
    hogs = [
        multiprocessing.Process(target=_hog, args=(os.getpid(),), daemon=True)
        for _ in range(args.hogs)
    ]
    for hog in hogs:
        hog.start()
    trials: dict[str, list[dict[str, Any]]] = {e: [] for e in EXECUTORS}
    try:
        for round_ in range(args.rounds):
            for executor in rotate(list(EXECUTORS), round_):
                root = work / f"{executor}-{round_}"
                trials[executor].append(_trial(root, executor, state, args.gap_s))
                print(executor, round_, trials[executor][-1], flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    summary = {}
    for executor, runs in trials.items():
        summary[executor] = {
            f"save{i + 1}_{what}": median([r["saves"][i][what] for r in runs])
            for i in (0, 1)
            for what in ("stall_s", "commit_s")
        }
        ready = [r["worker_ready_s"] for r in runs if r["worker_ready_s"] is not None]
        summary[executor]["worker_ready_s"] = median(ready) if ready else None
        summary[executor]["worker_saves"] = [r["worker_saves"] for r in runs]
        summary[executor]["sync_saves"] = sum(r["sync_saves"] for r in runs)
        summary[executor]["fallbacks"] = [r["fallback"] for r in runs if r["fallback"]]
    return {
        "machine": describe_machine(str(work)),
        "torch": torch.__version__,
        "state": args.state,
        "rounds": args.rounds,
        "gap_s": args.gap_s,
        "hogs": args.hogs,
        "summary": summary,
        "trials": trials,
    }


def report(results: dict[str, Any]) -> str:
    rows = []
    for executor, s in results["summary"].items():
        ready = s["worker_ready_s"]
        rows.append(
            [
                executor,
                *(f"{1000 * s[k]:.0f}" for k in ("save1_stall_s", "save1_commit_s")),
                *(f"{1000 * s[k]:.0f}" for k in ("save2_stall_s", "save2_commit_s")),
                "-" if ready is None else f"{ready:.1f}",
                ",".join(map(str, s["worker_saves"])),
                f"{s['sync_saves']} / {len(s['fallbacks'])}",
            ]
        )
    headers = [
        "executor",
        "save 1 stall ms",
        "save 1 commit ms",
        "save 2 stall ms",
        "save 2 commit ms",
        "worker ready s",
        "saves in worker (per round)",
        "sync saves / fallbacks",
    ]
    title = (
        f"{results['state']}, {results['rounds']} rounds, {results['gap_s']} s of training"
        f" between the saves, {results['hogs']} CPU hogs; medians"
    )
    return title + "\n\n" + markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", default="8x8MiB", type=lambda t: parse_state(t) and t)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=1.0)
    parser.add_argument("--hogs", type=int, default=0, help="busy-looping processes")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_first_saves_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_first_saves-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
