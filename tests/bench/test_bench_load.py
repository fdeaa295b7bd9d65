"""benchmarks/bench_load.py: both contenders save and load the same state, checked exactly.

A tiny state and no timing asserted: this proves the benchmark's code path (each writer's
checkpoint, rotated rounds, every load compared with the saved values, the report's ratios
and verdicts) runs, so the figures in docs/benchmarks.md come from a working measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load.py"


def _load_bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_a_tiny_run_measures_both_families_and_reports_each_target(tmp_path: Path) -> None:
    args = argparse.Namespace(rounds=2, sizes=[1], counts=[40], count_size_mib=1)
    results = bench.run(args, tmp_path)
    families = [row["family"] for row in results["rows"]]
    assert families == ["sizes", "counts"]
    for row in results["rows"]:
        for part in ("save", "load"):
            assert row["median_s"]["dcp_safe"][part] > 0 and row["median_s"]["torch"][part] > 0
            expected = row["median_s"]["dcp_safe"][part] / row["median_s"]["torch"][part]
            assert row["dcp_safe_over_torch"][part] == expected
    text = bench.report(results)
    assert "40 tensors, 1 MiB" in text and text.count("target <= 0.5") == 2
    assert list(tmp_path.iterdir()) == []  # every checkpoint it wrote is gone


def test_a_load_that_differs_from_the_save_stops_the_benchmark(tmp_path: Path) -> None:
    state = bench.make_state(1 << 16, 4)
    folder = tmp_path / "torch" / "kept"
    bench._save("torch", state, folder)
    changed = {k: v + 1 for k, v in state.items()}
    target = {k: v.clone() for k, v in state.items()}
    with pytest.raises(AssertionError, match="differs from the save"):
        bench._load("torch", changed, target, folder)
