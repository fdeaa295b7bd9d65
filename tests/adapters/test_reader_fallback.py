"""SafeStorageReader with a fallback tier: local first, the remote copy when local fails."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageReader, SafeStorageWriter
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed


@pytest.fixture
def remote(memory_root: str) -> str:
    return memory_root


def _mirror(local: Path, remote: str, name: str) -> None:
    """A byte-identical remote copy, as replication makes it."""
    fs = fsspec.filesystem("memory")
    for folder, _, files in os.walk(local / name):
        for file in files:
            source = Path(folder) / file
            fs.pipe_file(f"{remote}/{source.relative_to(local)}", source.read_bytes())


def _load(reader: SafeStorageReader, name: str, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    return target


def _flip_item(root: Path, name: str, fqn: str) -> None:
    manifest = open_committed(open_backend(str(root)), name).manifest
    item = next(i for i in manifest.items if i.fqn == fqn)
    shard = root / name / item.file
    data = bytearray(shard.read_bytes())
    data[item.start + item.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path: Path, remote: str) -> dict[str, Any]:
    state = make_state(5)
    dcp_safe.save(state, checkpoint_id="step_5", storage_writer=SafeStorageWriter(tmp_path))
    _mirror(tmp_path, remote, "step_5")
    return state


def test_a_checkpoint_missing_locally_loads_from_the_fallback(
    tmp_path: Path, remote: str, saved: dict[str, Any]
) -> None:
    shutil.rmtree(tmp_path / "step_5")
    reader = SafeStorageReader(tmp_path, fallback=remote)
    assert_state_equal(_load(reader, "step_5", saved), saved)
    assert_state_equal(_load(SafeStorageReader(tmp_path, fallback=remote), "latest", saved), saved)


def test_a_corrupt_local_item_is_read_from_the_remote_copy(
    tmp_path: Path, remote: str, saved: dict[str, Any]
) -> None:
    _flip_item(tmp_path, "step_5", "f32")
    reader = SafeStorageReader(tmp_path, fallback=remote)
    assert_state_equal(_load(reader, "step_5", saved), saved)
    assert reader.items_from_fallback == 1


def test_a_missing_local_shard_is_read_from_the_remote_copy(
    tmp_path: Path, remote: str, saved: dict[str, Any]
) -> None:
    (shard,) = (tmp_path / "step_5").glob("*.distcp")
    shard.unlink()
    reader = SafeStorageReader(tmp_path, fallback=remote)
    assert_state_equal(_load(reader, "step_5", saved), saved)
    assert reader.items_from_fallback > 0


def test_without_a_matching_remote_copy_corruption_is_still_an_error(
    tmp_path: Path, remote: str
) -> None:
    state = make_state(6)
    dcp_safe.save(state, checkpoint_id="step_6", storage_writer=SafeStorageWriter(tmp_path))
    other = tmp_path / "other"
    dcp_safe.save(state, checkpoint_id="step_6", storage_writer=SafeStorageWriter(other))
    _mirror(other, remote, "step_6")  # same name, another save: not a copy of ours
    _flip_item(tmp_path, "step_6", "f32")
    with pytest.raises(CheckpointCorruptError):
        _load(SafeStorageReader(tmp_path, fallback=remote), "step_6", state)


def test_latest_takes_the_replica_only_when_it_is_ahead_by_step(
    tmp_path: Path, remote: str, saved: dict[str, Any]
) -> None:
    newer = make_state(7)
    elsewhere = tmp_path / "elsewhere"
    writer = SafeStorageWriter(elsewhere, step=7)
    dcp_safe.save(newer, checkpoint_id="step_7", storage_writer=writer)
    _mirror(elsewhere, remote, "step_7")
    reader = SafeStorageReader(tmp_path, fallback=remote)
    assert_state_equal(_load(reader, "latest", newer), newer)
    assert reader.checkpoint_id == "step_7"


def test_a_replica_committed_later_but_not_ahead_by_step_does_not_win(
    tmp_path: Path, remote: str, saved: dict[str, Any]
) -> None:
    """A checkpoint planted on the replica (or one from a node with a fast clock) carries a
    later commit time; with no newer step, the healthy local tier stays "latest"."""
    planted = make_state(9)
    elsewhere = tmp_path / "elsewhere"
    dcp_safe.save(planted, checkpoint_id="step_9", storage_writer=SafeStorageWriter(elsewhere))
    _mirror(elsewhere, remote, "step_9")
    reader = SafeStorageReader(tmp_path, fallback=remote)
    assert_state_equal(_load(reader, "latest", saved), saved)
    assert reader.checkpoint_id == "step_5"
