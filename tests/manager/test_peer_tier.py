"""``CheckpointManager(Topology.of(root, node_local=..., peer_copies=K))``: node caches copied
to other nodes, and a restore after a node loss that reads nothing from the remote.

Two simulated nodes of two gloo ranks each: every rank sets ``LOCAL_WORLD_SIZE=2`` (so its node
is ``rank // 2``, as under torchrun) and uses its node's own folder, and one moto S3 root is the
remote. Node A's disk ends up holding node B's files in ``.peers/`` and the other way round; a
replaced node (its folder wiped) restores from them, over the ranks' network.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support import shard_rows

from dcp_safe import CheckpointManager, ConfigError, Runtime, Topology, layout, list_checkpoints
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.node_cache import list_peer_copies
from dcp_safe.errors import PeerCopyError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.reading.sources import ReadSource, RejectionReason
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.s3, pytest.mark.timeout(600)]

RANKS_PER_NODE = 2
STEPS = (1, 2, 3)


def _full(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(8, generator=gen)}


def _manager(rank: int, nodes: list[str], root: str, options: dict[str, Any]) -> CheckpointManager:
    per_node = 4 // len(nodes)  # 2 nodes x 2 ranks, or 4 nodes x 1 rank
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # node = rank // per_node, as torchrun says
    topology = Topology.of(
        root,
        node_local=nodes[rank // per_node],
        peer_copies=2 if len(nodes) == 2 else 3,
        storage_options=options,
    )
    return CheckpointManager(topology, keep_last=2)


def _save(
    rank: int,
    world_size: int,
    nodes: list[str],
    root: str,
    options: dict[str, Any],
    steps: tuple[int, ...] = STEPS,
) -> Any:
    with _manager(rank, nodes, root, options) as manager:
        for step in steps:
            handle = manager.save(step, shard_rows(world_size, _full(step)))
            assert handle is not None
            handle.committed.result(timeout=120)
        manager.wait(timeout_s=120)  # the peer copies too
        return manager.stats()


def _restore(
    rank: int, world_size: int, nodes: list[str], root: str, options: dict[str, Any]
) -> dict[str, Any]:
    target = shard_rows(world_size, {k: torch.zeros_like(v) for k, v in _full(0).items()})
    with _manager(rank, nodes, root, options) as manager:
        name = manager.restore(target)
        reader = manager.last_reader
    assert isinstance(reader, SafeStorageReader)
    assert [s.kind for s in reader.sources] == list(ReadSource)  # node cache, peer, remote
    return {
        "name": name,
        "state": {k: v.full_tensor() for k, v in target.items()},
        "stats": reader.stats(),
    }


def _replace_node(folder: str) -> None:
    """A node lost and replaced by a fresh one: its local disk is empty."""
    shutil.rmtree(folder)
    os.makedirs(folder)


def _flip_a_byte(copy: Path, file_name: str) -> None:
    manifest = Manifest.from_json((copy / layout.MANIFEST).read_bytes(), str(copy))
    item = next(i for i in manifest.items if i.file == file_name)
    data = bytearray((copy / file_name).read_bytes())
    data[item.start + item.length // 2] ^= 0xFF
    (copy / file_name).write_bytes(bytes(data))


def _assert_exact(seen: dict[str, Any], step: int = 3) -> None:
    assert seen["name"] == f"step_{step:09d}"
    for key, value in _full(step).items():
        assert torch.equal(seen["state"][key], value)


def test_a_replaced_node_restores_from_its_peer_copies_with_nothing_from_s3(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    nodes = [str(tmp_path / "node_a"), str(tmp_path / "node_b")]
    stats = run_ranks(_save, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    assert [(s.committed, s.peer_copies, s.peer_copy_failures) for s in stats] == [(3, 3, 0)] * 4

    # Each node holds the other's files of the newest two checkpoints (retention pruned step 1).
    for holder, other in ((0, 1), (1, 0)):
        copies = list_peer_copies(open_backend(nodes[holder]))
        assert [(c.name, c.node) for c in copies] == [
            ("step_000000002", other),
            ("step_000000003", other),
        ]
    newest = Path(nodes[0]) / layout.peer_copy_dir("step_000000003", 1)
    assert sorted(p.name for p in newest.glob("*.distcp")) == ["__2_0.distcp", "__3_0.distcp"]
    assert (newest / layout.PEER_COMMITTED_MARKER).exists()

    _replace_node(nodes[1])
    restored = run_ranks(_restore, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    for rank, seen in enumerate(restored):
        _assert_exact(seen)
        stats = seen["stats"]
        assert (stats.files_from_remote, stats.bytes_from_remote) == (0, 0)  # nothing from S3
        if rank < RANKS_PER_NODE:  # node A: its own cache
            assert (stats.files_from_cache, stats.files_from_peer) == (1, 0)
            assert stats.bytes_from_cache > 0
        else:  # node B, replaced: its files from node A's peer copy, over the network
            assert (stats.files_from_cache, stats.files_from_peer) == (0, 1)
            assert stats.bytes_from_peer > 0
            assert stats.cache_path is None

    # A corrupted peer copy is rejected as it lands, named, and that file read from S3.
    _replace_node(nodes[1])
    _flip_a_byte(newest, "__2_0.distcp")
    restored = run_ranks(_restore, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    for rank, seen in enumerate(restored):
        _assert_exact(seen)
        stats = seen["stats"]
        if rank == 2:
            assert (stats.files_from_peer, stats.files_from_remote) == (0, 1)
            assert stats.bytes_from_remote > 0
            [rejected] = [r for r in stats.rejections if r.source is ReadSource.PEER]
            assert (rejected.file, rejected.reason) == ("__2_0.distcp", RejectionReason.CHECKSUM)
            assert "rank 0" in rejected.detail or "rank 1" in rejected.detail
        elif rank == 3:
            assert (stats.files_from_peer, stats.files_from_remote) == (1, 0)
        else:
            assert (stats.files_from_cache, stats.files_from_remote) == (1, 0)

    # A replaced node whose disk holds a link as `.peers`: never followed, the tier passed by
    # with a warning and node B's files read from S3 (was: every rank's restore failed).
    _replace_node(nodes[1])
    outside = tmp_path / "outside"
    outside.mkdir()
    (Path(nodes[1]) / layout.PEERS_DIR).symlink_to(outside, target_is_directory=True)
    restored = run_ranks(_restore, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    for rank, seen in enumerate(restored):
        _assert_exact(seen)
        if rank >= RANKS_PER_NODE:
            stats = seen["stats"]
            assert (stats.files_from_peer, stats.files_from_remote) == (0, 1)
            assert any("symbolic link" in r.detail for r in stats.rejections)
    assert list(outside.iterdir()) == []


def test_four_nodes_with_three_copies_read_a_corrupted_copy_from_the_other_one(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    """4 nodes x 1 rank, peer_copies=3: node 1's files are on nodes 2 and 3. Node 1 is replaced
    and node 2's copy is corrupted: the file comes from node 3's copy, never from S3."""
    nodes = [str(tmp_path / f"node_{n}") for n in range(4)]
    stats = run_ranks(_save, 4, args=(nodes, s3_root, s3_options, (1,)), timeout_s=400)
    assert [(s.committed, s.peer_copies, s.peer_copy_failures) for s in stats] == [(1, 1, 0)] * 4
    for holder in range(4):
        copies = list_peer_copies(open_backend(nodes[holder]))
        assert sorted(c.node for c in copies) == sorted({(holder - 1) % 4, (holder - 2) % 4})

    _replace_node(nodes[1])
    _flip_a_byte(Path(nodes[2]) / layout.peer_copy_dir("step_000000001", 1), "__1_0.distcp")
    restored = run_ranks(_restore, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    for rank, seen in enumerate(restored):
        _assert_exact(seen, step=1)
        stats = seen["stats"]
        assert (stats.files_from_remote, stats.bytes_from_remote) == (0, 0)
        if rank == 1:
            assert stats.files_from_peer == 1
            [rejected] = [r for r in stats.rejections if r.source is ReadSource.PEER]
            assert (rejected.file, rejected.reason) == ("__1_0.distcp", RejectionReason.CHECKSUM)
            assert rejected.detail.startswith("rank 2:")
        else:
            assert (stats.files_from_cache, stats.files_from_peer) == (1, 0)


def _save_with_a_full_disk(
    rank: int, world_size: int, nodes: list[str], root: str, options: dict[str, Any]
) -> dict[str, Any]:
    with _manager(rank, nodes, root, options) as manager:
        handle = manager.save(1, shard_rows(world_size, _full(1)))
        assert handle is not None
        handle.committed.result(timeout=120)
        try:
            manager.wait(timeout_s=120)
        except PeerCopyError as exc:
            failure: PeerCopyError | None = exc
        else:
            failure = None
        return {"stats": manager.stats(), "failure": failure}


def test_a_failed_peer_copy_is_raised_and_counted_and_the_checkpoint_stays(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    nodes = [str(tmp_path / "node_a"), str(tmp_path / "node_b")]
    os.makedirs(nodes[1])
    (Path(nodes[1]) / layout.PEERS_DIR).write_text("not a folder")  # node B cannot hold copies
    outcomes = run_ranks(_save_with_a_full_disk, 4, args=(nodes, s3_root, s3_options))
    for outcome in outcomes:
        stats, failure = outcome["stats"], outcome["failure"]
        assert (stats.committed, stats.peer_copies, stats.peer_copy_failures) == (1, 0, 1)
        assert isinstance(failure, PeerCopyError)
        assert failure.name == "step_000000001"
        assert list(failure.failures) == [2]  # node B's leader could not land node A's files
    listed = [c.name for c in list_checkpoints(s3_root, storage_options=s3_options)]
    assert listed == ["step_000000001"]  # committed, whatever the peer copy did
    assert list_peer_copies(open_backend(nodes[0])) != []  # node A got node B's copy


def _too_many_copies(rank: int, world_size: int, nodes: list[str]) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    with pytest.raises(ConfigError, match="peer_copies=3 needs at least 3 nodes") as caught:
        CheckpointManager(
            Topology.of(nodes[rank] + "/remote", node_local=nodes[rank], peer_copies=3)
        )
    return str(caught.value)


def test_more_copies_than_nodes_is_refused_on_every_rank(tmp_path: Path) -> None:
    nodes = [str(tmp_path / "a"), str(tmp_path / "b")]
    messages = run_ranks(_too_many_copies, 2, args=(nodes,))
    assert all("this job has 2" in message for message in messages)


def test_peer_copies_need_node_local_and_several_nodes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="peer_copies= needs node_local="):
        CheckpointManager(Topology.of(tmp_path / "remote", peer_copies=2))
    with pytest.raises(ConfigError, match="needs a multi-node job"):
        CheckpointManager(
            Topology.of(tmp_path / "remote", node_local=tmp_path / "n", peer_copies=2)
        )
    with pytest.raises(ConfigError, match="peer_copies must be an int >= 1"):
        CheckpointManager(
            Topology.of(tmp_path / "remote", node_local=tmp_path / "n", peer_copies=0)
        )


def _own_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """One entry of this rank's own: every rank's file holds data (no DTensor crosses to a
    worker process)."""
    return {f"rank{rank}": torch.full((256,), float(100 * rank + step))}


def _save_in_workers(
    rank: int, world_size: int, nodes: list[str], root: str, options: dict[str, Any]
) -> Any:
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)
    topology = Topology.of(
        root, node_local=nodes[rank // RANKS_PER_NODE], peer_copies=2, storage_options=options
    )
    with CheckpointManager(topology, runtime=Runtime(executor="process")) as manager:
        for step in (1, 2):
            handle = manager.save(step, _own_state(rank, step))
            assert handle is not None
            handle.committed.result(timeout=120)
        manager.wait(timeout_s=120)
        return manager.stats()


def _restore_own(
    rank: int, world_size: int, nodes: list[str], root: str, options: dict[str, Any]
) -> dict[str, Any]:
    target = {f"rank{rank}": torch.zeros(256)}
    with _manager(rank, nodes, root, options) as manager:
        name = manager.restore(target)
        stats = manager.last_reader.stats()  # type: ignore[union-attr]
    return {
        "name": name,
        "exact": torch.equal(target[f"rank{rank}"], _own_state(rank, 2)[f"rank{rank}"]),
        "stats": stats,
    }


def test_saves_made_by_worker_processes_are_copied_to_peers_too(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    """``executor="process"``: the workers commit and publish the node caches, the parents copy
    them to peers; a replaced node then restores from its peer copies alone."""
    nodes = [str(tmp_path / "node_a"), str(tmp_path / "node_b")]
    stats = run_ranks(_save_in_workers, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    assert [(s.committed, s.peer_copies, s.peer_copy_failures) for s in stats] == [(2, 2, 0)] * 4
    _replace_node(nodes[1])
    restored = run_ranks(_restore_own, 4, args=(nodes, s3_root, s3_options), timeout_s=400)
    for rank, seen in enumerate(restored):
        assert (seen["name"], seen["exact"]) == ("step_000000002", True)
        assert (seen["stats"].files_from_remote, seen["stats"].bytes_from_remote) == (0, 0)
        assert seen["stats"].files_from_peer == (1 if rank >= RANKS_PER_NODE else 0)
