"""benchmarks/bench_torch_checkpointing.py: both storages save and load the same state.

Tiny shapes and no timing asserted: this proves the benchmark's code path (torch_checkpointing's
own storage and ours, each round's save, evicted and warm loads checked bit for bit, the ratios
in the report) runs, so the figures in docs/torch_checkpointing.md come from a working
measurement. The async saver's stall (a subprocess per storage) is left to the benchmark itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import load_script

pytest.importorskip("torch_checkpointing")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_torch_checkpointing.py"

bench = load_script(SCRIPT)


def test_a_tiny_run_measures_ours_against_torch_checkpointings_own_storage(
    tmp_path: Path,
) -> None:
    results = bench.run(tmp_path, {"tiny": (3, 64 * 1024)}, rounds=2, stall=False)
    entry = results["shapes"]["tiny"]
    assert entry["bytes"] == 3 * 64 * 1024
    figures = entry["figures"]
    for contender in bench.CONTENDERS:
        walls = ["load_evicted_s", "load_warm_s", "save_s"]
        assert sorted(figures[contender]) == sorted(walls + [k[:-1] + "cpu" for k in walls])
        assert all(figures[contender][key] > 0 for key in walls), contender
        assert all(seconds >= 0 for seconds in figures[contender].values()), contender
    ratio = figures["ratio"]["save_s"]
    assert ratio == figures["dcp_safe"]["save_s"] / figures["tc local"]["save_s"]
    assert figures["durable floor"]["save_s"] > 0  # the same bytes written and fsynced
    text = bench.report(results)
    assert "| tiny | save_s |" in text and "<= 1.15" in text and "durable floor" in text
    assert "| tiny | save_cpu |" in text
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == []  # each round's root removed
