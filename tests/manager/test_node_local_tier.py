"""``CheckpointManager(Topology.of(root, node_local=...))``: node-local saves, restores from the
node caches.

Two simulated nodes of two gloo ranks each (ranks 0-1 share "node A"'s local directory, 2-3
"node B"'s) and one moto S3 root. The manager saves through each node's disk and commits on S3
(history and retention there, once); a restart on the same topology restores every file from
its node's cache, checked against S3's manifest, and a corrupted cached file from S3 instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import shard_rows

from dcp_safe import CheckpointManager, ConfigError, Topology, layout, list_checkpoints
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.manifest.schema import Manifest
from dcp_safe.reading.sources import RejectionReason
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.s3, pytest.mark.timeout(300)]

RANKS_PER_NODE = 2


def _full(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(8, generator=gen)}


def _save(rank: int, world_size: int, nodes: list[str], root: str, options: dict[str, Any]) -> int:
    node = nodes[rank // RANKS_PER_NODE]
    topology = Topology.of(root, node_local=node, storage_options=options)
    with CheckpointManager(topology, keep_last=2) as manager:
        for step in (1, 2, 3):
            handle = manager.save(step, shard_rows(world_size, _full(step)))
            assert handle is not None
            handle.committed.result(timeout=120)  # the S3 commit exists
        return manager.stats().committed


def _restore(
    rank: int, world_size: int, nodes: list[str], root: str, options: dict[str, Any]
) -> dict[str, Any]:
    node = nodes[rank // RANKS_PER_NODE]
    target = shard_rows(world_size, {k: torch.zeros_like(v) for k, v in _full(0).items()})
    topology = Topology.of(root, node_local=node, storage_options=options)
    with CheckpointManager(topology, keep_last=2) as manager:
        name = manager.restore(target)
        reader = manager.last_reader
    assert isinstance(reader, SafeStorageReader) and reader.node_cache is not None
    return {
        "name": name,
        "state": {k: v.full_tensor() for k, v in target.items()},
        "stats": reader.stats(),
    }


def _flip_a_byte(cache: Path, file_name: str) -> None:
    manifest = Manifest.from_json((cache / layout.MANIFEST).read_bytes(), str(cache))
    item = next(i for i in manifest.items if i.file == file_name)
    data = bytearray((cache / file_name).read_bytes())
    data[item.start + item.length // 2] ^= 0xFF
    (cache / file_name).write_bytes(bytes(data))


def test_node_local_saves_commit_on_s3_and_restarts_read_the_node_caches(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    nodes = [str(tmp_path / "node_a"), str(tmp_path / "node_b")]
    committed = run_ranks(_save, 4, args=(nodes, s3_root, s3_options), timeout_s=240)
    assert committed == [3, 3, 3, 3]
    listed = [c.name for c in list_checkpoints(s3_root, storage_options=s3_options)]
    assert listed == ["step_000000002", "step_000000003"]  # retention ran on S3, once

    restored = run_ranks(_restore, 4, args=(nodes, s3_root, s3_options), timeout_s=240)
    for seen in restored:
        assert seen["name"] == "step_000000003"
        for key, value in _full(3).items():
            assert torch.equal(seen["state"][key], value)
        assert (seen["stats"].files_from_cache, seen["stats"].files_from_remote) == (1, 0)

    broken = layout.shard_file_name(1, 0)
    _flip_a_byte(Path(nodes[0]) / "step_000000003", broken)
    restored = run_ranks(_restore, 4, args=(nodes, s3_root, s3_options), timeout_s=240)
    for rank, seen in enumerate(restored):
        for key, value in _full(3).items():
            assert torch.equal(seen["state"][key], value)  # exact: rank 1's file from S3
        stats = seen["stats"]
        if rank == 1:
            assert (stats.files_from_cache, stats.files_from_remote) == (0, 1)
            [rejection] = stats.rejections
            assert (rejection.file, rejection.reason) == (broken, RejectionReason.CHECKSUM)
        else:
            assert (stats.files_from_cache, stats.files_from_remote) == (1, 0)


def test_node_local_does_not_take_a_replica_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="node_local= and replicate_to="):
        CheckpointManager(
            Topology.of(tmp_path / "remote", node_local=tmp_path / "n", replicate_to="x")
        )
