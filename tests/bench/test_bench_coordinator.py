"""benchmarks/bench_coordinator.py: the world-size simulation publishes checkpoints that verify.

Tiny world sizes only, and no timing is asserted: this proves the benchmark's code path (lay
down N ranks' outputs as the writer does, time rank 0's publish, report, plot) works, and that
what it publishes is a real checkpoint — verified byte for byte and loadable by torch's reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import load_script
from torch.distributed.checkpoint import FileSystemReader

import dcp_safe
from dcp_safe import layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.testing import world

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_coordinator.py"


bench = load_script(SCRIPT)


def test_four_simulated_ranks_publish_a_checkpoint_that_verifies_and_loads(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    save = world.simulate(backend, "step_4", 4)
    manifest = world.publish(backend, save, workers=3)

    assert manifest.world_size == 4
    assert len(manifest.items) == 4 * world.ITEMS_PER_RANK
    assert backend.exists(f"step_4/{layout.COMMITTED_MARKER}")
    report = dcp_safe.verify_checkpoint(tmp_path, "step_4")
    assert report is not None
    # Torch's own reader loads every rank's rows: the simulated shards are DCP's format.
    rows = 4 * world.ROWS_PER_RANK
    state = {
        f"layers.{k}.weight": torch.zeros(rows, world.COLUMNS) for k in range(world.ITEMS_PER_RANK)
    }
    dcp.load(state, storage_reader=FileSystemReader(str(tmp_path / "step_4")), no_dist=True)
    for k in range(world.ITEMS_PER_RANK):
        for rank in range(4):
            block = state[f"layers.{k}.weight"][
                rank * world.ROWS_PER_RANK : (rank + 1) * world.ROWS_PER_RANK
            ]
            assert torch.all(block == float(rank * 1000 + k))


@pytest.mark.s3
def test_four_simulated_ranks_publish_on_s3(s3_root: str, s3_options: dict[str, Any]) -> None:
    backend = open_backend(s3_root, s3_options)
    save = world.simulate(backend, "step_4", 4)
    world.publish(backend, save, workers=2)
    assert backend.exists(f"step_4/{layout.COMMITTED_MARKER}")
    assert not backend.exists(f"step_4/{layout.WRITING_LEASE}")
    dcp_safe.verify_checkpoint(s3_root, "step_4", storage_options=s3_options)


def test_the_benchmark_runs_end_to_end_and_writes_its_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "coordinator.json", tmp_path / "coordinator.png"
    argv = ["--world-sizes", "2", "4", "--rounds", "2", "--roots", "local", "--workers", "2"]
    argv += ["--serial", "--dir", str(tmp_path), "--out", str(out), "--plot", str(png)]
    assert bench.main(argv) == 0

    results = json.loads(out.read_text())
    by_workers = results["roots"]["local"]
    assert sorted(by_workers) == ["1", "2"]
    for points in by_workers.values():
        assert sorted(points) == ["2", "4"]
        assert all(len(p["samples_s"]) == 2 for p in points.values())
    assert any("linear" in target for target in results["targets"])
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-coordinator-")] == []


@pytest.mark.s3
def test_the_s3_request_floor_gets_each_rank_manifest_and_is_reported(
    s3: Any, s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    backend = open_backend(f"s3://{s3_bucket}/coord", s3_options)
    floor = bench.get_floor(s3, s3_bucket, "coord", 2)  # a missing key would raise NoSuchKey
    by_workers = bench.measure_root("s3", backend, [3], 1, [2], backend.remove_tree, floor)
    point = by_workers["2"]["3"]
    assert len(point["floor_samples_s"]) == 1
    assert point["floor_median_s"] > 0 and point["over_floor"] > 0
    results = {"workers": 2, "serial_workers": None, "roots": {"s3": by_workers}}
    results["targets"] = bench.targets(results)
    assert "publish / floor" in bench.report(results)
