"""benchmarks/bench_export.py: every contender runs in its own process and reports a peak.

A tiny checkpoint and no timing asserted: this proves the benchmark's code path (the
checkpoint, one subprocess per contender and round, the kernel's peak-RSS mark, the report's
ratios) runs, so the figures in docs/export.md come from a working measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_export.py"

bench = load_script(SCRIPT)

pytestmark = [pytest.mark.multiproc]


def test_a_tiny_run_measures_every_contender_against_torch_save(tmp_path: Path) -> None:
    args = argparse.Namespace(rounds=1, sizes=[2], tensors=2)
    results = bench.run(args, tmp_path)
    (row,) = results["rows"]
    assert sorted(row["median"]) == sorted(bench.CONTENDERS)
    for contender, measured in row["median"].items():
        assert measured["seconds"] > 0 and measured["growth_bytes"] >= 0, contender
        expected = measured["seconds"] / row["median"]["torch.save"]["seconds"]
        assert row["time_over_torch_save"][contender] == expected
    assert row["largest_tensor_bytes"] == 1 << 20
    text = bench.report(results)
    assert "export safetensors" in text and "dcp_to_torch_save" in text
    assert list(tmp_path.iterdir()) == []  # the checkpoint and every output are gone
