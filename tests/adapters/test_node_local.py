"""A simulated two-node job: node-local roots, one shared S3 root (moto), restore from S3 alone.

Four gloo ranks: ranks 0-1 are "node A" and save to local root A, ranks 2-3 are "node B" with
local root B, as node-local NVMe would be; no node can see the other's files. Each rank uploads
its own files to the shared S3 root and rank 0 commits there once every rank's rank manifest
arrived. Checked: the S3 checkpoint is complete and verified, restores exactly on one process
and on two ranks; the node roots hold only node caches (their own ranks' shards, a
``_NODE_COMMITTED`` marker) that are never listed or loaded as checkpoints; a rank whose upload
or write fails makes every rank's replication future fail, through storage markers, and nothing
is committed.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcp_safe
from dcp_safe import (
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    SafeStorageReader,
    SafeStorageWriter,
    Topology,
    WriterOptions,
    layout,
    list_checkpoints,
    verify_checkpoint,
)
from dcp_safe.adapters.node_local import NodeLocalOptions, NodeLocalWriter
from dcp_safe.checkpoints.node_cache import NODE_COMMITTED_MARKER, list_node_caches
from dcp_safe.errors import ReplicationTimeoutError, UploadTimeoutError
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.topology import Root

pytestmark = [pytest.mark.timeout(300)]

RANKS_PER_NODE = 2
W_SHAPE, B_LEN = (8, 4), 6
FAST = NodeLocalOptions(remote_timeout_s=120.0, poll_s=0.25)


def _values(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _full_state(seed: int) -> dict[str, Any]:
    return {"w": _values(seed, *W_SHAPE), "b": _values(seed + 1, B_LEN), "meta": {"seed": seed}}


def _sharded(world_size: int, full: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
        "meta": dict(full["meta"]),
    }


class _UploadFailsOnRank3(NodeLocalWriter):
    """Rank 3's upload to the remote fails, after its local write succeeded."""

    def _upload_rank(self, assignment: Any, work: str) -> None:
        if assignment.rank == 3:
            raise OSError(errno.EIO, "injected upload failure on rank 3")
        super()._upload_rank(assignment, work)


class _WriteFailsOnRank2(NodeLocalWriter):
    """Rank 2's local write fails inside write_data; the other ranks already upload theirs."""

    def _write_rank(self, assignment: Any, *args: Any) -> Any:
        if assignment.rank == 2:
            raise OSError(errno.EIO, "injected write failure on rank 2")
        return super()._write_rank(assignment, *args)


class _NeverUploads(NodeLocalWriter):
    """A rank that goes silent after its local write: its remote rank manifest never comes."""

    def _upload_rank(self, assignment: Any, work: str) -> None:
        return None


# --------------------------------------------------------------- rank functions (module level)


def _save_on_two_nodes(
    rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any]
) -> dict[str, Any]:
    root = roots[rank // RANKS_PER_NODE]
    seen: dict[str, Any] = {}
    writer = NodeLocalWriter(root, remote=Root(remote, options), node_options=FAST)
    dcp_safe.save(
        _sharded(world_size, _full_state(1)), checkpoint_id="step_1", storage_writer=writer
    )
    seen["committed_save_id"] = writer.replication("step_1").result(timeout=120).save_id
    writer.close(timeout_s=60)

    failing = _UploadFailsOnRank3(root, remote=Root(remote, options), node_options=FAST)
    dcp_safe.save(
        _sharded(world_size, _full_state(2)), checkpoint_id="step_2", storage_writer=failing
    )
    error = failing.replication("step_2").exception(timeout=120)
    seen["failure"] = (type(error).__name__, str(error))

    broken = _WriteFailsOnRank2(root, remote=Root(remote, options), node_options=FAST)
    try:
        dcp_safe.save(
            _sharded(world_size, _full_state(3)), checkpoint_id="step_3", storage_writer=broken
        )
    except CommitError as exc:
        seen["write_failure"] = sorted(exc.failures)
    if rank != 2:  # the others' background uploads learn of it from storage, not a timeout
        error = broken.replication("step_3").exception(timeout=120)
        seen["upload_after_write_failure"] = (type(error).__name__, str(error))
    seen["listed_locally"] = [info.name for info in list_checkpoints(root)]
    return seen


def _rank1_never_uploads(rank: int, world_size: int, root: str, remote: str) -> Any:
    options = NodeLocalOptions(remote_timeout_s=1.0, poll_s=0.05)
    kind = _NeverUploads if rank == 1 else NodeLocalWriter
    writer = kind(f"{root}/node{rank}", remote=remote, node_options=options)
    dcp_safe.save(
        _sharded(world_size, _full_state(1)), checkpoint_id="step_1", storage_writer=writer
    )
    error = writer.replication("step_1").exception(timeout=60)
    return type(error).__name__, getattr(error, "failures", None)


def _restore_on_two_ranks(
    rank: int, world_size: int, remote: str, options: dict[str, Any]
) -> dict[str, Any]:
    target = _sharded(
        world_size, {"w": torch.zeros(W_SHAPE), "b": torch.zeros(B_LEN), "meta": {"seed": -1}}
    )
    reader = SafeStorageReader(remote, storage_options=options)
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=reader)
    assert isinstance(target["w"], DTensor)
    return {
        "w_local": target["w"].to_local(),
        "w": target["w"].full_tensor(),
        "b": target["b"].full_tensor(),
        "meta": target["meta"],
    }


# --------------------------------------------------------------- tests


@pytest.mark.multiproc
@pytest.mark.s3
def test_two_nodes_upload_their_own_shards_and_restore_from_s3_alone_on_fewer_ranks(
    tmp_path: Path,
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    node_a, node_b = tmp_path / "node_a", tmp_path / "node_b"
    roots = [str(node_a), str(node_b)]

    per_rank = run_ranks(_save_on_two_nodes, 4, args=(roots, s3_root, s3_options))

    # The complete checkpoint is on S3 only, committed once, with every rank's shards.
    assert len({seen["committed_save_id"] for seen in per_rank}) == 1
    [info] = list_checkpoints(s3_root, storage_options=s3_options)
    assert (info.name, info.world_size) == ("step_1", 4)
    report = verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    assert report.items_checked == 4 * 2 + 1  # a shard of w and of b per rank, and meta.seed

    # Each node root holds a node cache of its own ranks' shards, never a checkpoint.
    for root, ranks in ((node_a, (0, 1)), (node_b, (2, 3))):
        assert list_checkpoints(root) == []
        [cache] = list_node_caches(root)
        assert (cache.name, cache.ranks, cache.manifest.save_id) == (
            "step_1",
            ranks,
            per_rank[0]["committed_save_id"],
        )
        shards = sorted(p.name for p in (root / "step_1").glob(f"*{layout.SHARD_SUFFIX}"))
        assert shards == [layout.shard_file_name(r, 0) for r in ranks]
        assert (root / "step_1" / NODE_COMMITTED_MARKER).exists()
        assert not (root / "step_1" / layout.COMMITTED_MARKER).exists()
        with pytest.raises(CheckpointNotFoundError):
            SafeStorageReader(root).reset("latest")
        with pytest.raises(CheckpointNotFoundError):
            SafeStorageReader(root).reset("step_1")

    # A failed upload on rank 3 failed every rank's replication future; nothing is committed.
    for rank, seen in enumerate(per_rank):
        kind, message = seen["failure"]
        assert kind == ("OSError" if rank == 3 else "CommitError"), (rank, kind)
        assert "injected upload failure on rank 3" in message
        assert seen["listed_locally"] == []
    assert [c.name for c in list_checkpoints(s3_root, storage_options=s3_options)] == ["step_1"]
    # A rank failing in write_data fails the save (DCP) and every other rank's upload future.
    for rank, seen in enumerate(per_rank):
        assert seen["write_failure"] == [2]
        if rank != 2:
            kind, message = seen["upload_after_write_failure"]
            assert kind == "CommitError" and "injected write failure on rank 2" in message
    for root in (node_a, node_b):
        assert [cache.name for cache in list_node_caches(root)] == ["step_1"]
        assert sorted(os.listdir(root))[-1] == "step_1"  # step_2's work stays hidden

    # Restore from S3 alone: on one process (one node, one rank) ...
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    expected = _full_state(1)
    whole = {"w": torch.zeros(W_SHAPE), "b": torch.zeros(B_LEN), "meta": {"seed": -1}}
    dcp_safe.load(whole, storage_reader=SafeStorageReader(s3_root, storage_options=s3_options))
    assert torch.equal(whole["w"], expected["w"]) and torch.equal(whole["b"], expected["b"])
    assert whole["meta"] == expected["meta"]

    # ... and on two ranks of one node, resharded from four to two.
    restored = run_ranks(_restore_on_two_ranks, 2, args=(s3_root, s3_options))
    for rank, seen in enumerate(restored):
        assert torch.equal(seen["w"], expected["w"]) and torch.equal(seen["b"], expected["b"])
        assert torch.equal(seen["w_local"], expected["w"].chunk(2)[rank])
        assert seen["meta"] == expected["meta"]


def test_one_process_keeps_the_newest_node_caches_and_every_remote_checkpoint(
    tmp_path: Path, memory_root: str
) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    options = NodeLocalOptions(remote_timeout_s=60.0, poll_s=0.01, keep_node_caches=2)
    writer = NodeLocalWriter(tmp_path, remote=memory_root, node_options=options)
    for step in (1, 2, 3):
        state = _full_state(step)
        dcp_safe.save(state, checkpoint_id=f"step_{step}", storage_writer=writer)
        assert writer.replication(f"step_{step}").result(timeout=60).name == f"step_{step}"
    writer.close(timeout_s=60)

    remote = [info.name for info in list_checkpoints(memory_root)]
    assert remote == ["step_1", "step_2", "step_3"]
    assert [(c.name, c.ranks) for c in list_node_caches(tmp_path)] == [
        ("step_2", (0,)),
        ("step_3", (0,)),
    ]
    assert not (tmp_path / "step_1").exists()
    assert list_checkpoints(tmp_path) == []
    target = {"w": torch.zeros(W_SHAPE), "b": torch.zeros(B_LEN), "meta": {"seed": -1}}
    dcp_safe.load(target, checkpoint_id="step_2", storage_reader=SafeStorageReader(memory_root))
    assert torch.equal(target["w"], _full_state(2)["w"]) and target["meta"] == {"seed": 2}


def test_the_remote_manifest_records_the_step_and_metrics_of_a_node_local_save(
    tmp_path: Path, memory_root: str
) -> None:
    # Retention's keep_best ranks checkpoints by these metrics: a node-local tier must keep them.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    options = NodeLocalOptions(remote_timeout_s=60.0, poll_s=0.01)
    writer = NodeLocalWriter(tmp_path, remote=memory_root, node_options=options)
    view = writer.for_step(7, {"val_loss": 0.5})
    dcp_safe.save(_full_state(1), checkpoint_id="step_7", storage_writer=view)
    writer.replication("step_7").result(timeout=60)
    writer.close(timeout_s=60)
    [info] = list_checkpoints(memory_root)
    assert (info.name, info.step, info.metrics) == ("step_7", 7, {"val_loss": 0.5})


@pytest.mark.multiproc
def test_a_rank_stalled_in_its_upload_is_named_as_itself_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 never uploads its part: rank 0 gives up after remote_timeout_s naming rank 1
    (UploadTimeoutError, a CommitError), and rank 1, which waits for the remote commit, reads
    the same ranks from rank 0's failure marker: not "rank 0 failed"."""
    remote = str(tmp_path / "remote")
    outcomes = run_ranks(_rank1_never_uploads, 2, args=(str(tmp_path), remote))
    assert outcomes[0][0] == "UploadTimeoutError" and sorted(outcomes[0][1]) == [1]
    assert outcomes[1][0] == "CommitError" and sorted(outcomes[1][1]) == [1]
    assert "did not upload its part" in outcomes[1][1][1]
    assert list_checkpoints(remote) == []


def test_node_local_writer_refuses_options_that_would_break_the_tier(
    tmp_path: Path, memory_root: str
) -> None:
    with pytest.raises(ConfigError, match="overwrite"):
        NodeLocalWriter(tmp_path, remote=memory_root, overwrite=True)
    with pytest.raises(ConfigError, match="overwrite"):
        NodeLocalWriter(tmp_path, remote=memory_root, options=WriterOptions(overwrite=True))
    topology = Topology.of(memory_root, node_local=tmp_path)
    with pytest.raises(ConfigError, match=r"Topology\.of"):
        NodeLocalWriter(topology, remote=memory_root)
    with pytest.raises(ConfigError, match="node cache"):
        NodeLocalWriter(Topology.of(memory_root))
    with pytest.raises(ConfigError, match="NodeLocalWriter"):
        SafeStorageWriter(topology)
    with pytest.raises(ConfigError, match="local directory"):
        NodeLocalWriter(memory_root, remote=str(tmp_path))
    with pytest.raises(ConfigError, match="keep_node_caches"):
        NodeLocalOptions(keep_node_caches=0)
    with pytest.raises(ConfigError, match="positive"):
        NodeLocalOptions(remote_timeout_s=0)


def test_a_rank_that_never_uploads_times_the_remote_commit_out_and_nothing_is_published(
    tmp_path: Path, memory_root: str
) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    options = NodeLocalOptions(remote_timeout_s=1.0, poll_s=0.05)
    writer = _NeverUploads(tmp_path, remote=memory_root, node_options=options)
    dcp_safe.save(_full_state(1), checkpoint_id="step_1", storage_writer=writer)

    error = writer.replication("step_1").exception(timeout=60)
    assert isinstance(error, ReplicationTimeoutError)
    assert "every rank's manifest" in str(error)
    assert isinstance(error, UploadTimeoutError) and list(error.failures) == [0]
    with pytest.raises(ReplicationTimeoutError):
        writer.close(timeout_s=60)
    assert list_checkpoints(memory_root) == []
    assert list_node_caches(tmp_path) == [] and list_checkpoints(tmp_path) == []
