"""How long ``dcp-safe ls``, ``history`` and ``show`` take on a root of 100 checkpoints, against
the interpreter's own start, measured in the same run.

Usage::

    .venv/bin/python benchmarks/bench_cli_startup.py [--checkpoints 100] [--rounds 7] [--dir D]

Writes ``--checkpoints`` committed checkpoints (a small state each, ``dcp_safe.save``) under a
fresh root, then runs each command as a new process (``sys.executable``), rotating their order
from round to round, and reports each one's median wall time and its ratio to ``python -c
pass`` (the floor every command pays) and to ``python -c "import torch"`` (what every command
paid before the CLI stopped importing torch). Results go to
``benchmarks/results/bench_cli_startup-<time>.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    describe_machine_line,
    fmt_seconds,
    markdown_table,
    median,
    rotate,
    write_results,
)

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions


def _root(folder: Path, count: int) -> Path:
    root = folder / "run"
    for step in range(1, count + 1):
        writer = SafeStorageWriter(root, step=step, options=WriterOptions(fsync=False))
        state = {"w": torch.full((64, 64), float(step)), "step": step}
        dcp_safe.save(state, checkpoint_id=f"step_{step:09d}", storage_writer=writer)
    return root


def _timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", help="where to write the root (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = str(_root(Path(folder), args.checkpoints))
        py = sys.executable
        cli = [py, "-m", "dcp_safe.cli"]
        commands = {
            "python -c pass": [py, "-c", "pass"],
            'python -c "import torch"': [py, "-c", "import torch"],
            "dcp-safe ls ROOT": [*cli, "ls", root],
            "dcp-safe ls ROOT --json": [*cli, "ls", root, "--json"],
            "dcp-safe history ROOT": [*cli, "history", root],
            "dcp-safe show ROOT latest": [*cli, "show", root],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for name in commands:  # one warm-up each: the page cache, not the code, is cold
            _timed(commands[name])
        for round_ in range(args.rounds):
            for name in rotate(list(commands), round_):
                times[name].append(_timed(commands[name]))
    medians = {name: median(values) for name, values in times.items()}
    floor, torch_start = medians["python -c pass"], medians['python -c "import torch"']
    machine = describe_machine()
    print(describe_machine_line(machine))
    print(f"{args.checkpoints} committed checkpoints, {args.rounds} rounds, medians")
    print(
        markdown_table(
            ["command", "wall", "/ python -c pass", "/ import torch"],
            [
                [name, fmt_seconds(m), f"{m / floor:.2f}x", f"{m / torch_start:.2f}x"]
                for name, m in medians.items()
            ],
        )
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = write_results(
        Path(__file__).resolve().parent / "results" / f"bench_cli_startup-{stamp}.json",
        {"machine": machine, "args": vars(args), "seconds": times, "medians": medians},
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
