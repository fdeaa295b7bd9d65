"""benchmarks/bench_peer_restore.py: each restart restores exactly and counts bytes per source.

A tiny state and no timing asserted: this proves the benchmark's code path (the save with peer
copies, the node loss and its undoing, each restart checked exactly on every rank, the bytes
per source summed over ranks) runs, so the figures in docs/benchmarks.md come from a working
measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peer_restore.py"

pytestmark = [pytest.mark.multiproc, pytest.mark.s3, pytest.mark.timeout(600)]

bench = load_script(SCRIPT)


def test_a_tiny_run_reads_a_lost_node_s_share_from_peers_or_from_s3(tmp_path: Path) -> None:
    args = argparse.Namespace(nodes=2, ranks_per_node=2, state="2x64KiB", rounds=1)
    results = bench.run(args, tmp_path)
    rows = {row["scenario"]: row for row in results["rows"]}
    intact, peers, plain = rows["intact"], rows["node lost, peers"], rows["node lost, no peers"]
    total = intact["bytes"]["node cache"]  # the stored bytes: the state's, and framing
    assert total >= 2 * 64 * 1024
    assert intact["bytes"] == {"node cache": total, "peer": 0, "remote": 0}
    lost = peers["bytes"]["peer"]  # node 1's share: from peers, or from S3 without them
    assert 0 < lost < total
    assert peers["bytes"] == {"node cache": total - lost, "peer": lost, "remote": 0}
    assert plain["bytes"] == {"node cache": total - lost, "peer": 0, "remote": lost}
    assert peers["files"] == {"node cache": 2, "peer": 2, "remote": 0}
    assert results["save"]["peers_done_s"] >= results["save"]["commit_s"] > 0
    text = bench.report(results)
    assert "node lost, no peers" in text and "| 1.00 |" in text
