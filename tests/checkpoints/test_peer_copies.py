"""Peer copies on a node's disk: whole or absent, trusted only with their marker, pruned.

A peer copy is built here from a real committed checkpoint's files (what a buddy node's leader
receives over the network, each file checked as it lands) and committed as the peer tier does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import make_state

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.checkpoints.node_cache import (
    commit_peer_copy,
    list_node_caches,
    list_peer_copies,
    open_peer_copy,
    prune_peer_copies,
)
from dcp_safe.errors import CheckpointExistsError


def _landed(source: Path, node_root: Path, name: str, node: int) -> tuple[str, bytes]:
    """Node ``node``'s files of ``name`` landed in a partial folder on ``node_root``."""
    partial = layout.peer_partial_dir(name, node, layout.new_save_id())
    shutil.copytree(source / name, node_root / partial)
    for control in (layout.COMMITTED_MARKER, layout.MANIFEST):
        (node_root / partial / control).unlink()
    return partial, (source / name / layout.MANIFEST).read_bytes()


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    root = tmp_path / "remote"
    for step in (1, 2, 3):
        writer = SafeStorageWriter(root, options=WriterOptions(fsync=False), step=step)
        dcp_safe.save(make_state(step), checkpoint_id=f"step_{step}", storage_writer=writer)
    return root


def test_a_committed_copy_is_whole_marked_and_invisible_to_node_cache_listings(
    tmp_path: Path, remote: Path
) -> None:
    node_root = tmp_path / "node_a"
    node_root.mkdir()
    local = LocalBackend(str(node_root))
    partial, raw = _landed(remote, node_root, "step_1", 1)
    folder = commit_peer_copy(local, partial, "step_1", 1, raw)
    assert folder == layout.peer_copy_dir("step_1", 1)
    assert not (node_root / partial).exists()  # renamed into place
    copy = open_peer_copy(local, "step_1", 1)
    assert (copy.name, copy.node, copy.rel) == ("step_1", 1, folder)
    assert [(c.name, c.node) for c in list_peer_copies(local)] == [("step_1", 1)]
    assert list_node_caches(node_root) == []  # another node's share is no cache of this node
    assert dcp_safe.list_checkpoints(node_root) == []

    again, raw = _landed(remote, node_root, "step_1", 1)
    with pytest.raises(CheckpointExistsError):
        commit_peer_copy(local, again, "step_1", 1, raw)


def test_a_copy_whose_marker_does_not_match_its_manifest_is_not_used(
    tmp_path: Path, remote: Path
) -> None:
    node_root = tmp_path / "node_a"
    node_root.mkdir()
    local = LocalBackend(str(node_root))
    partial, raw = _landed(remote, node_root, "step_1", 1)
    folder = commit_peer_copy(local, partial, "step_1", 1, raw)
    (node_root / folder / layout.PEER_COMMITTED_MARKER).write_text("xxh3:0")
    with pytest.raises(CheckpointCorruptError):
        open_peer_copy(local, "step_1", 1)
    assert list_peer_copies(local) == []
    # A partial copy (no marker, not renamed) is no copy either.
    _landed(remote, node_root, "step_2", 0)
    assert list_peer_copies(local, "step_2") == []


def test_pruning_keeps_the_newest_checkpoints_copies_and_drops_partials_of_older_ones(
    tmp_path: Path, remote: Path
) -> None:
    node_root = tmp_path / "node_a"
    node_root.mkdir()
    local = LocalBackend(str(node_root))
    for name in ("step_1", "step_2", "step_3"):
        for node in (1, 2):
            partial, raw = _landed(remote, node_root, name, node)
            commit_peer_copy(local, partial, name, node, raw)
    _landed(remote, node_root, "step_1", 3)  # a failed copy's leftovers
    assert prune_peer_copies(local, keep=2) == ["step_1"]
    assert [(c.name, c.node) for c in list_peer_copies(local)] == [
        ("step_2", 1),
        ("step_2", 2),
        ("step_3", 1),
        ("step_3", 2),
    ]
    assert not (node_root / layout.PEERS_DIR / "step_1").exists()
