"""benchmarks/bench_rollback.py: every way back to the committed step is timed and checked exactly.

A tiny state and no timing asserted: this proves the benchmark's path (a kept commit, rollback,
warm and evicted restores and the copy floor, each compared with the committed values) runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support import load_script

bench = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rollback.py")


def test_a_tiny_run_times_every_contender_against_a_warm_restore(tmp_path: Path) -> None:
    results = bench.run(argparse.Namespace(states=["4x64KiB"], rounds=2), tmp_path)
    (row,) = results["rows"]
    assert row["tensors"] == 4 and row["bytes"] == 4 * 64 * 1024
    assert set(row["median_s"]) == set(bench.CONTENDERS)
    assert all(seconds > 0 for seconds in row["median_s"].values())
    assert row["over_restore_warm"]["restore_warm"] == 1.0
    assert "4x64KiB" in bench.report(results)


def test_a_state_is_count_x_size() -> None:
    assert bench.parse_state("16x16MiB") == (16, 16 << 20)
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_state("16 tensors")
