"""benchmarks/bench_load.py: both contenders save and load the same state, checked exactly.

A tiny state and no timing asserted: this proves the benchmark's code path (each writer's
checkpoint, rotated rounds, every load compared with the saved values, the report's ratios
and verdicts) runs, so the figures in docs/benchmarks.md come from a working measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load.py"


bench = load_script(SCRIPT)


def test_a_tiny_run_measures_both_families_and_reports_each_target(tmp_path: Path) -> None:
    args = argparse.Namespace(
        rounds=2,
        sizes=[1],
        counts=[40],
        count_size_mib=1,
        count_tensor_kib=0,
        cache=["warm", "evicted"],
    )
    results = bench.run(args, tmp_path)
    families = [row["family"] for row in results["rows"]]
    assert families == ["sizes", "counts"]
    for row in results["rows"]:
        for part in ("save", "load", "load_evicted"):
            assert row["median_s"]["dcp_safe"][part] > 0 and row["median_s"]["torch"][part] > 0
            expected = row["median_s"]["dcp_safe"][part] / row["median_s"]["torch"][part]
            assert row["dcp_safe_over_torch"][part] == expected
    text = bench.report(results)
    assert "40 tensors, 1 MiB" in text and text.count("target <= 0.5") == 3
    assert "load (evicted) ratio" in text
    assert list(tmp_path.iterdir()) == []  # every checkpoint it wrote is gone


def test_counted_tensors_can_be_sized_each_rather_than_in_total(tmp_path: Path) -> None:
    args = argparse.Namespace(
        rounds=1, sizes=[], counts=[8], count_size_mib=1, count_tensor_kib=4, cache=["evicted"]
    )
    (row,) = bench.run(args, tmp_path)["rows"]
    assert row["label"] == "8 x 4 KiB" and row["bytes"] == 8 * 4 * 1024
    assert set(row["median_s"]["torch"]) == {"save", "load_evicted"}


def test_a_load_that_differs_from_the_save_stops_the_benchmark(tmp_path: Path) -> None:
    state = bench.make_state(1 << 16, 4)
    folder = tmp_path / "torch" / "kept"
    bench._save("torch", state, folder)
    changed = {k: v + 1 for k, v in state.items()}
    target = {k: v.clone() for k, v in state.items()}
    with pytest.raises(AssertionError, match="differs from the save"):
        bench._load("torch", changed, target, folder)
