"""benchmarks/bench_load_memory.py: every reader loads the same state exactly, in a subprocess.

A tiny state, one round and no figure asserted: this proves the benchmark's code path (the
three checkpoints, each contender's child process, the exactness check, the report) runs, so
the figures in docs/benchmarks.md come from a working measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load_memory.py"

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

bench = load_script(SCRIPT)


def test_a_tiny_run_reports_every_reader_for_both_kinds_of_target(tmp_path: Path) -> None:
    args = argparse.Namespace(load_budget=1, rounds=1, tensors=2, tensor_mib=1, threads=2)
    results = bench.run(args, tmp_path)
    assert [row["targets"] for row in results["rows"]] == ["direct"] * 5 + ["copied"] * 5
    assert all(row["seconds"] > 0 for row in results["rows"])
    text = bench.report(results)
    assert text.count("1 MiB budget") == 4 and text.count("torch FileSystemReader") == 2
