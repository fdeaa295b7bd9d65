"""What a Python-bound training loop feels while a checkpoint is written in the background.

Usage::

    .venv/bin/python benchmarks/bench_training_feel.py [--states 16x16MiB,10000x32KiB]
        [--rounds 3] [--step-ms 10] [--steady-steps 60] [--pre-steps 20] [--tail-steps 40]
        [--contenders dcp_thread,dcp_process,dcp_safe,manager,manager_process]
        [--process-sharing S] [--dir D]
        [--quick]

An async save's *stall* (how long ``save()`` blocks the training thread) is only half of what
training pays: the background phase (planning, serialising, writing, hashing, committing) runs
Python on threads of the same process, and every bytecode it runs takes the GIL from the
training thread. This benchmark measures that second half, with a training step that is pure
Python (a dict-and-arithmetic loop calibrated to ``--step-ms``, plus one 64x64 matmul) and no
sleeps, so the step time is a direct reading of how much GIL the training thread gets.

Per state (``COUNTxSIZE``, float32 tensors in one flat dict) and round, in one process:

1. *Steady state*: ``--steady-steps`` steps with no save; their mean and median.
2. Per contender, the order rotated per round, each on a fresh folder under a temporary root:
   one untimed warm-up save (first round only: DCP's checkpoint process spawns, the stager's
   buffers are allocated), then ``--pre-steps`` steps, then ``save()`` on the training thread
   (its duration is the *stall*), then steps until the background phase has ended and
   ``--tail-steps`` more ran.

Contenders:

* ``dcp_thread``: ``torch.distributed.checkpoint.async_save`` with its default (thread)
  executor and a ``FileSystemWriter``; background phase = until its future resolves.
* ``dcp_process``: the same with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``
  (uploads run in a checkpoint daemon process; the staged copy is sent to it over a pipe, each
  tensor as shared memory: with torch's default ``file_descriptor`` strategy one descriptor per
  tensor, so a state with more tensors than ``ulimit -n`` allows fails; ``--process-sharing
  file_system`` passes shared-memory names instead).
* ``dcp_safe``: ``dcp_safe.async_save`` with a ``SafeStorageWriter`` and a ``BudgetedStager``;
  stall = the call plus ``staging_completion``; background phase = ``upload_completion``.
* ``manager``: ``CheckpointManager(root, runtime=Runtime(executor="thread")).save(step, state)``;
  background phase = until ``handle.committed`` resolves (committed, verified, retention ran).
* ``manager_process``: the same with ``executor="process"`` (what the default, ``"auto"``,
  chooses here): the stager copies into shared slabs, and the write, commit and checksums run
  in the manager's worker process (started with the manager, which waits until it is ready:
  saves before that run on a thread), and so does the check of each new checkpoint; retention
  still runs here.

All contenders run under one 1-rank gloo process group (``127.0.0.1``), which DCP's process
executor needs and a real job has; it is created here unless one exists, and destroyed after.

Figures per row (medians over rounds; ratios against the same round's steady state):

* ``stall_ms``: ``save()`` on the training thread (call until it may step again).
* ``steady_ms``: the steady-state mean step time.
* ``bg_ratio``: mean duration of the steps that started after ``save()`` returned and before the
  background phase ended, over the steady mean (1.0 = the save cost the loop nothing).
  ``bg_ratio_vs_pre`` divides the same mean by that of the ``--pre-steps`` steps just before
  this save instead: on a shared host whose load moves within a round it is the steadier one.
* ``lost_s``: what the save cost the loop in time: the stall plus, over the steps counted in
  ``bg_ratio``, each one's excess over the steady mean (a long mild slowdown can cost more than
  a short sharp one; ``bg_ratio`` alone would favour the former).
* ``window_s``: how long the loop stays slow, from the ``save()`` call. Each step after the
  call gets a smoothed duration: the median of the ``2*SMOOTH_HALF + 1`` steps centred on it
  (clipped at the ends of the run). The window ends at the end of the last step whose smoothed
  duration exceeds ``SLOW_FACTOR`` (1.05) x the steady *median*, or when ``save()`` returned if
  no step does; ``window_steps`` is how many steps ended inside it. Median smoothing ignores a
  lone slow step (a neighbour's burst on a shared host) but not a run of them.
* ``background_s``: from the ``save()`` call until the background phase ended.

A contender that cannot run here (no process group, the daemon fails to start) gets a row with
the reason instead of figures. Prints a markdown table and writes JSON to
``benchmarks/results/bench_training_feel-<time>.json``, with the host's load average at start and
end: per-item Python costs move with the host's load, so compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    describe_machine_line,
    markdown_table,
    median,
    rotate,
    run_and_report,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDERS = ["dcp_thread", "dcp_process", "dcp_safe", "manager", "manager_process"]
SLOW_FACTOR = 1.05
SMOOTH_HALF = 2
_UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
QUICK = {
    "states": "16x1MiB,1000x32KiB",
    "rounds": 1,
    "step_ms": 5.0,
    "steady_steps": 20,
    "pre_steps": 5,
    "tail_steps": 12,
}

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StateSpec:
    """``count`` float32 tensors of ``tensor_bytes`` each, written ``COUNTxSIZE``."""

    count: int
    tensor_bytes: int
    label: str


def parse_state(text: str) -> StateSpec:
    """``"16x16MiB"`` or ``"10000x32KiB"`` (units B, KiB, MiB, GiB; case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*([kmg]?i?b)\s*", text, re.IGNORECASE)
    if match is None or match.group(3).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected COUNTxSIZE like 16x16MiB, got {text!r}")
    count, size = int(match.group(1)), int(match.group(2)) * _UNITS[match.group(3).upper()]
    if count < 1 or size < 4:
        raise argparse.ArgumentTypeError(f"{text!r}: need >= 1 tensor of >= 4 bytes")
    return StateSpec(count, size, f"{count:,} x {text.split('x', 1)[1].strip()}")


def make_state(spec: StateSpec) -> State:
    gen = torch.Generator().manual_seed(0)
    numel = spec.tensor_bytes // 4
    return {f"layers.{i:05d}.weight": torch.randn(numel, generator=gen) for i in range(spec.count)}


# -- the training step ----------------------------------------------------------------------------


def _python_work(iterations: int) -> int:
    """The GIL-bound part of a step: dict updates and integer arithmetic, nothing released."""
    table: dict[int, int] = {}
    total = 0
    for i in range(iterations):
        key = i & 255
        table[key] = table.get(key, 0) + (i * 7) % 13
        total += table[key]
    return total


class TrainingStep:
    """One step: ``iterations`` of :func:`_python_work` and one small matmul."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self._small = torch.ones(64, 64)

    def __call__(self) -> None:
        _python_work(self.iterations)
        self._small = (self._small @ self._small).clamp_(-1.0, 1.0)

    @classmethod
    def calibrated(cls, target_ms: float) -> TrainingStep:
        """Size the loop so a step takes about ``target_ms`` on this host, now."""
        probe = 20_000
        seconds = median([_timed_call(lambda: _python_work(probe)) for _ in range(5)])
        return cls(max(1_000, int(probe * target_ms / 1e3 / max(seconds, 1e-9))))


def _timed_call(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_steps(step: TrainingStep, count: int) -> list[tuple[float, float]]:
    """``count`` steps back to back; each one's (start, end) in ``perf_counter`` seconds."""
    spans = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        spans.append((start, time.perf_counter()))
    return spans


# -- the contenders -------------------------------------------------------------------------------


class Contender:
    """Starts one save of ``state``: blocks for the stall, returns the background phase."""

    def start(self, state: State, folder: Path, step: int) -> Future[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the contender holds (stagers, writers, managers)."""


class DcpAsync(Contender):
    def __init__(self, process: bool) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD

    def start(self, state: State, folder: Path, step: int) -> Future[Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        response = dcp.async_save(
            state, storage_writer=FileSystemWriter(folder), async_checkpointer_type=self.kind
        )
        if isinstance(response, Future):
            return response
        response.staging_completion.result()
        return response.upload_completion


class DcpSafeAsync(Contender):
    def __init__(self, root: Path) -> None:
        from dcp_safe import BudgetedStager, SafeStorageWriter

        self.writer = SafeStorageWriter(root)
        self.stager = BudgetedStager()

    def start(self, state: State, folder: Path, step: int) -> Future[Any]:
        import dcp_safe

        response = dcp_safe.async_save(
            state, checkpoint_id=folder.name, storage_writer=self.writer, async_stager=self.stager
        )
        self.stager.track(response)
        response.staging_completion.result()
        upload: Future[Any] = response.upload_completion
        return upload

    def close(self) -> None:
        self.stager.close()
        self.writer.close()


class ManagerSave(Contender):
    def __init__(self, root: Path, executor: str = "thread") -> None:
        from dcp_safe import CheckpointManager, Runtime

        self.manager = CheckpointManager(root, runtime=Runtime(executor=executor))
        worker = self.manager._runner.worker
        if worker is not None:  # until it is ready, saves run on a thread: measure the worker's
            worker.start()
            while not worker.ready:
                time.sleep(0.01)

    def start(self, state: State, folder: Path, step: int) -> Future[Any]:
        handle = self.manager.save(step, state)
        if handle is None:
            raise RuntimeError("the manager skipped the save")
        committed: Future[Any] = handle.committed
        return committed

    def close(self) -> None:
        self.manager.close()


def make_contender(name: str, root: Path) -> Contender:
    if name in ("dcp_thread", "dcp_process"):
        return DcpAsync(process=name == "dcp_process")
    if name == "dcp_safe":
        return DcpSafeAsync(root)
    if name in ("manager", "manager_process"):
        return ManagerSave(root, executor="process" if name == "manager_process" else "thread")
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")


# -- one measured save ----------------------------------------------------------------------------


def _smoothed(durations: list[float]) -> list[float]:
    n = len(durations)
    return [
        median(durations[max(0, i - SMOOTH_HALF) : min(n, i + SMOOTH_HALF + 1)]) for i in range(n)
    ]


def feel(
    steady: list[tuple[float, float]],
    called: float,
    returned: float,
    ended: float,
    after: list[tuple[float, float]],
) -> dict[str, Any]:
    """The figures of one save from its timestamps (see the module docstring for definitions).

    Args:
        steady: the steady-state steps' (start, end).
        called: when ``save()`` was called; returned: when it returned.
        ended: when the background phase ended.
        after: the steps run after ``save()`` returned.
    """
    steady_d = [end - start for start, end in steady]
    steady_mean, steady_median = sum(steady_d) / len(steady_d), median(steady_d)
    during = [end - start for start, end in after if start < ended]
    slow = [
        i
        for i, d in enumerate(_smoothed([end - start for start, end in after]))
        if d > SLOW_FACTOR * steady_median
    ]
    window_end = after[slow[-1]][1] if slow else returned
    return {
        "stall_s": returned - called,
        "steady_mean_s": steady_mean,
        "steady_median_s": steady_median,
        "background_s": ended - called,
        "steps_during_background": len(during),
        "background_mean_step_s": sum(during) / len(during) if during else None,
        "bg_ratio": sum(during) / len(during) / steady_mean if during else None,
        "lost_s": returned - called + sum(d - steady_mean for d in during),
        "window_s": window_end - called,
        "window_steps": slow[-1] + 1 if slow else 0,
        "steps_after": len(after),
    }


def measure_save(
    contender: Contender,
    state: State,
    folder: Path,
    step: TrainingStep,
    steady: list[tuple[float, float]],
    args: argparse.Namespace,
    number: int,
) -> dict[str, Any]:
    gc.collect()
    pre = run_steps(step, args.pre_steps)
    ended: list[float] = []
    called = time.perf_counter()
    background = contender.start(state, folder, number)
    returned = time.perf_counter()
    background.add_done_callback(lambda _: ended.append(time.perf_counter()))
    after: list[tuple[float, float]] = []
    deadline = returned + args.max_wait_s
    tail = 0
    while tail < args.tail_steps:
        after += run_steps(step, 1)
        if ended:
            tail += 1
        elif after[-1][1] > deadline:
            raise TimeoutError(f"the background phase ran past --max-wait-s {args.max_wait_s}")
    background.result()  # a failed save is a row with its error, not figures
    row = feel(steady, called, returned, ended[0], after)
    pre_mean = sum(end - start for start, end in pre) / len(pre)
    during = row["background_mean_step_s"]
    row["pre_mean_s"] = pre_mean
    row["bg_ratio_vs_pre"] = None if during is None else during / pre_mean
    return row


# -- the run --------------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _one_state(
    spec: StateSpec, names: list[str], step: TrainingStep, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    state = make_state(spec)
    contenders: dict[str, Contender] = {}
    rows: dict[str, dict[str, Any]] = {name: {"rounds": []} for name in names}
    for name in names:
        root = work / name
        try:
            contenders[name] = make_contender(name, root)
            contenders[name].start(state, root / "warm_up", 0).result()
        except BaseException as exc:  # a contender that cannot run here says why
            if isinstance(exc, KeyboardInterrupt):
                raise
            rows[name]["reason"] = _error(exc)
            contenders.pop(name, None)
    rounds = []
    try:
        for round_ in range(args.rounds):
            gc.collect()
            steady = run_steps(step, args.steady_steps)
            rounds.append({"load_average": os.getloadavg(), "order": []})
            for name in rotate(names, round_):
                if name not in contenders or "reason" in rows[name]:
                    continue
                rounds[-1]["order"].append(name)
                folder = work / name / f"r{round_:03d}"
                try:
                    row = measure_save(
                        contenders[name], state, folder, step, steady, args, round_ + 1
                    )
                except Exception as exc:
                    rows[name]["reason"] = _error(exc)
                    continue
                rows[name]["rounds"].append(row)
            print(f"  {spec.label}: round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for contender in contenders.values():
            contender.close()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "state": spec.label,
        "tensors": spec.count,
        "bytes": spec.count * (spec.tensor_bytes // 4) * 4,
        "rounds": rounds,
        "contenders": {name: _summarise(rows[name]) for name in names},
    }


_SUMMARY_KEYS = (
    "stall_s",
    "steady_mean_s",
    "bg_ratio",
    "bg_ratio_vs_pre",
    "lost_s",
    "window_s",
    "window_steps",
)


def _summarise(row: dict[str, Any]) -> dict[str, Any]:
    if "reason" in row or not row["rounds"]:
        return {"reason": row.get("reason", "no round ran"), "rounds": row["rounds"]}
    summary: dict[str, Any] = {"rounds": row["rounds"]}
    for key in (*_SUMMARY_KEYS, "background_s"):
        values = [r[key] for r in row["rounds"] if r.get(key) is not None]
        summary[key] = median(values) if values else None
    if summary["bg_ratio"] is None:
        summary["reason"] = "the background phase ended before the first step after save()"
    return summary


class _ProcessGroup:
    """A 1-rank gloo group on 127.0.0.1 for the run, unless one exists; torn down after."""

    def __enter__(self) -> _ProcessGroup:
        import torch.distributed as dist
        from torch.distributed.elastic.utils.distributed import get_free_port

        self.owned = dist.is_available() and not dist.is_initialized()
        if self.owned:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's process executor reads it
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{get_free_port()}",
                rank=0,
                world_size=1,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor as process_executor

        daemon = getattr(process_executor, "_CHECKPOINT_PROCESS", None)
        if daemon is not None:  # the checkpoint daemon outlives saves; stop it with the group
            daemon.__del__()
            process_executor._CHECKPOINT_PROCESS = None
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    load_start = os.getloadavg()
    step = TrainingStep.calibrated(args.step_ms)
    results: dict[str, Any] = {
        "machine": describe_machine(str(work)),
        "load_average_start": load_start,
        "step_iterations": step.iterations,
        "args": {k: v for k, v in vars(args).items() if k != "states"},
        "slow_factor": SLOW_FACTOR,
        "smooth_half": SMOOTH_HALF,
        "states": [],
    }
    sharing = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(args.process_sharing)
    try:
        with _ProcessGroup():
            for i, spec in enumerate(args.states):
                results["states"].append(_one_state(spec, names, step, args, work / f"state{i}"))
    finally:
        torch.multiprocessing.set_sharing_strategy(sharing)
    results["load_average_end"] = os.getloadavg()
    return results


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(results: dict[str, Any]) -> str:
    lines = [describe_machine_line(results["machine"])]
    start, end = results["load_average_start"], results["load_average_end"]
    lines.append(f"load average (1, 5, 15 min): start {start}, end {end}")
    headers = [
        "state",
        "contender",
        "stall (ms)",
        "steady step (ms)",
        "background-phase step / steady",
        "/ pre-save steps",
        "lost (s)",
        "window (s)",
        "steps in window",
        "background (s)",
        "note",
    ]
    rows = []
    for entry in results["states"]:
        for name, row in entry["contenders"].items():
            rows.append(
                [
                    entry["state"],
                    name,
                    _cell(row.get("stall_s") and row["stall_s"] * 1e3, ".1f"),
                    _cell(row.get("steady_mean_s") and row["steady_mean_s"] * 1e3, ".2f"),
                    _cell(row.get("bg_ratio"), ".2f"),
                    _cell(row.get("bg_ratio_vs_pre"), ".2f"),
                    _cell(row.get("lost_s"), ".2f"),
                    _cell(row.get("window_s"), ".2f"),
                    _cell(row.get("window_steps"), ".0f"),
                    _cell(row.get("background_s"), ".2f"),
                    row.get("reason", ""),
                ]
            )
    return "\n".join([*lines, "", markdown_table(headers, rows)])


def _save_results(results: dict[str, Any]) -> Path:
    return write_results(
        RESULTS / f"bench_training_feel-{time.strftime('%Y%m%d-%H%M%S')}.json", results
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", default="16x16MiB,10000x32KiB", help="COUNTxSIZE,...")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=10.0, help="target step time")
    parser.add_argument("--steady-steps", type=int, default=60)
    parser.add_argument("--pre-steps", type=int, default=20, help="steps before each save")
    parser.add_argument("--tail-steps", type=int, default=40, help="steps after it ended")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="per background phase")
    parser.add_argument(
        "--process-sharing",
        choices=["file_descriptor", "file_system"],
        default="file_descriptor",
        help="torch.multiprocessing sharing strategy for dcp_process (torch's default first)",
    )
    parser.add_argument("--dir", help="scratch parent folder (default: the system's temp)")
    parser.add_argument("--quick", action="store_true", help="tiny states, one round (< 1 min)")
    args = parser.parse_args(argv)
    if args.quick:  # --quick sets what the command line left at its default
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    args.states = [parse_state(s) for s in str(args.states).split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(
        "bench_training_feel_", args.dir, lambda work: run(args, work), report, _save_results
    )


if __name__ == "__main__":
    sys.exit(main())
