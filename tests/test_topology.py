"""``Topology``: one value says which root commits, which is a replica, which a node cache.

The manager builds it from its arguments and every part reads roles from it (``writer.topology``),
so a node-local save and ``replicate_to=`` are two configurations of one value, not a subclass
that redefines ``replicate_to``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dcp_safe import (
    CheckpointManager,
    ConfigError,
    NodeLocalWriter,
    Root,
    SafeStorageReader,
    SafeStorageWriter,
    Topology,
    WriterOptions,
    list_checkpoints,
)
from dcp_safe.adapters.node_local import writer_for
from dcp_safe.checkpoints.node_cache import list_node_caches
from dcp_safe.topology import this_node


def test_one_root_commits_and_uploads_nowhere(tmp_path: Path) -> None:
    topology = Topology.of(tmp_path / "ckpt")
    assert topology.commit == Root(str(tmp_path / "ckpt"))
    assert topology.writes_to == topology.commit
    assert topology.uploads_to is None


def test_a_replica_is_uploaded_to_after_the_commit_root_is_written() -> None:
    options = {"anon": True}
    topology = Topology.of("/nvme/ckpt", replicate_to="s3://b/ckpt", storage_options=options)
    assert topology.writes_to.url == "/nvme/ckpt"
    assert topology.uploads_to == Root("s3://b/ckpt")
    assert topology.uploads_to.storage_options == options  # the replica's default options
    assert topology.node_cache is None


def test_a_node_local_save_writes_to_its_node_and_uploads_to_the_commit_root() -> None:
    topology = Topology.of("s3://b/ckpt", node_local="/nvme/cache")
    assert topology.commit.url == "s3://b/ckpt"
    assert topology.writes_to == Root("/nvme/cache")
    assert topology.uploads_to == topology.commit
    assert topology.replica is None


def test_a_node_cache_and_a_replica_do_not_go_together() -> None:
    with pytest.raises(ConfigError, match="node_local= and replicate_to="):
        Topology.of("s3://b/ckpt", replicate_to="s3://c/ckpt", node_local="/nvme/cache")
    with pytest.raises(ConfigError, match="non-empty"):
        Root("")


def test_each_writer_says_its_topology(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    replicating = SafeStorageWriter(local, replicate_to=remote)
    assert replicating.topology == Topology.of(local, replicate_to=remote)
    assert replicating.commit_backend is replicating.backend

    node = NodeLocalWriter(local, remote=remote)
    assert node.topology == Topology.of(remote, node_local=local)
    assert node.replicate_to is None  # the remote is its commit root, not a replica
    assert node.commit_backend is node.remote
    assert node.commit_backend.url == str(remote)


def test_writer_for_builds_the_writer_of_each_configuration(tmp_path: Path) -> None:
    plain = writer_for(Topology.of(tmp_path / "a"), options=WriterOptions(compression="zstd"))
    assert type(plain) is SafeStorageWriter
    assert plain.options.compression.value == "zstd"
    cached = Topology.of(tmp_path / "r", node_local=tmp_path / "n")
    node = writer_for(cached, remote_timeout_s=7)
    assert isinstance(node, NodeLocalWriter)
    assert node.node_options.remote_timeout_s == 7
    assert node.topology is cached  # the writer keeps the topology it was given


@pytest.mark.parametrize("roots", ["a path", "a replica", "a node cache"])
def test_a_manager_builds_its_topology_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, roots: str
) -> None:
    built: list[Topology] = []
    validate = Topology.__post_init__

    def counted(topology: Topology) -> None:
        built.append(topology)
        validate(topology)

    monkeypatch.setattr(Topology, "__post_init__", counted)
    root: Path | Topology = tmp_path / "root"
    if roots == "a replica":
        root = Topology.of(root, replicate_to=tmp_path / "replica")
    elif roots == "a node cache":
        root = Topology.of(root, node_local=tmp_path / "node")
    with CheckpointManager(root) as manager:
        assert len(built) == 1  # the user's own Topology.of, or the manager's
        assert manager.topology is built[0] and manager.writer.topology is built[0]


def test_a_node_local_manager_commits_on_its_commit_root_and_caches_on_its_node(
    tmp_path: Path,
) -> None:
    remote, node = tmp_path / "remote", tmp_path / "node"
    topology = Topology.of(remote, node_local=node)
    state = {"w": torch.arange(12.0)}
    with CheckpointManager(topology, keep_last=2) as manager:
        assert manager.topology == topology
        assert manager.root == str(remote)
        handle = manager.save(1, state)
        assert handle is not None
        handle.committed.result(timeout=60)
    assert [c.name for c in list_checkpoints(remote)] == [handle.name]
    assert list_checkpoints(node) == []  # a node cache is never a checkpoint
    assert [c.name for c in list_node_caches(node)] == [handle.name]
    # History lives with the checkpoints, on the commit root only.
    assert [p.name for p in remote.glob("_history*")] and not list(node.glob("_history*"))


def test_the_peer_tier_is_part_of_the_topology_and_of_its_writer(tmp_path: Path) -> None:
    topology = Topology.of("s3://b/run", node_local=tmp_path / "nvme", peer_copies=2)
    assert topology.peer_copies == 2
    writer = writer_for(topology)
    assert isinstance(writer, NodeLocalWriter)
    assert writer.topology == topology
    # The peer transfers' chunk buffers are held beside the uploads' and counted with them.
    plain = writer_for(Topology.of("s3://b/run", node_local=tmp_path / "nvme"))
    assert writer.upload_buffer_bytes is not None and plain.upload_buffer_bytes is not None
    assert writer.upload_buffer_bytes > plain.upload_buffer_bytes


def test_peer_copies_are_refused_without_a_node_cache_or_below_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="peer_copies= needs node_local="):
        Topology.of(tmp_path / "ckpt", peer_copies=2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="peer_copies must be an int >= 1"):
            Topology.of(tmp_path / "ckpt", node_local=tmp_path / "n", peer_copies=bad)  # type: ignore[arg-type]


def test_a_rank_s_node_is_what_torchrun_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert [this_node(rank) for rank in range(3)] == [0, 1, 2]  # one rank per node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [this_node(rank) for rank in range(4)] == [0, 0, 1, 1]
    monkeypatch.setenv("GROUP_RANK", "7")  # torchrun's own number wins
    assert this_node(0) == 7
    monkeypatch.setenv("GROUP_RANK", "x")
    with pytest.raises(ConfigError, match="GROUP_RANK"):
        this_node(0)


def test_a_root_carries_its_options_to_every_entry_point(tmp_path: Path) -> None:
    """A ``Root`` goes where a path goes; its options are those the backend is opened with."""
    options = {"auto_mkdir": True}
    remote = Root(f"file://{tmp_path / 'remote'}", storage_options=options)
    topology = Topology.of(tmp_path / "local", replicate_to=remote)
    assert topology.replica is remote
    root = Root(str(tmp_path / "root"), storage_options={})
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False))
    assert writer.topology.commit is root
    writer.close()
    assert list_checkpoints(root) == [] == list_checkpoints(str(tmp_path / "root"))


@pytest.mark.parametrize(
    ("build", "where"),
    [
        (
            lambda p: SafeStorageWriter(p, replicate_to="r", replicate_storage_options={}),
            "SafeStorageWriter(replicate_storage_options=) moved to replicate_to=Root(url,",
        ),
        (
            lambda p: NodeLocalWriter(p, remote="r", remote_storage_options={}),
            "NodeLocalWriter(remote_storage_options=) moved to remote=Root(url,",
        ),
        (
            lambda p: Topology.of(p, replicate_to="r", replica_storage_options={}),
            "Topology.of(replica_storage_options=) moved to replicate_to=Root(url,",
        ),
        (
            lambda p: SafeStorageReader(p, fallback="r", fallback_storage_options={}),
            "SafeStorageReader(fallback_storage_options=) moved to fallback=Root(url,",
        ),
        (
            lambda p: SafeStorageReader(p, node_cache="c", node_cache_storage_options={}),
            "SafeStorageReader(node_cache_storage_options=) moved to node_cache=Root(url,",
        ),
    ],
)
def test_a_second_roots_options_moved_into_its_root(
    tmp_path: Path, build: Callable[[Path], object], where: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        build(tmp_path)
    assert where in str(caught.value)


def test_options_beside_a_root_are_refused_not_merged(tmp_path: Path) -> None:
    root = Root(str(tmp_path), storage_options={"auto_mkdir": True})
    for call in (
        lambda: list_checkpoints(root, storage_options={}),
        lambda: SafeStorageReader(root, storage_options={}),
        lambda: Topology.of(root, storage_options={}),
    ):
        with pytest.raises(ConfigError, match=r"inside it, Root\(url, storage_options"):
            call()
