"""SafeStorageReader: which checkpoint it opens, and what it refuses to load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    SafeStorageReader,
    SafeStorageWriter,
    layout,
)
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.errors import InvalidCheckpointNameError


def _save(root: Path, name: str, state: dict[str, Any]) -> None:
    dcp_safe.save(state, checkpoint_id=name, storage_writer=SafeStorageWriter(root))


def _load(root: Path, name: str | None, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root))
    return target


def test_latest_is_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    states = {name: make_state(i) for i, name in enumerate(["step_9", "step_10", "step_2"])}
    for name, state in states.items():
        _save(tmp_path, name, state)
    # Newest by commit time, not by name order.
    assert_state_equal(_load(tmp_path, "latest", states["step_2"]), states["step_2"])


def test_without_a_checkpoint_id_the_reader_opens_latest(tmp_path: Path) -> None:
    _save(tmp_path, "step_1", make_state(1))
    _save(tmp_path, "step_2", make_state(2))
    assert_state_equal(_load(tmp_path, None, make_state(2)), make_state(2))


def test_latest_skips_a_newer_checkpoint_that_does_not_open(tmp_path: Path) -> None:
    _save(tmp_path, "step_1", make_state(1))
    _save(tmp_path, "step_2", make_state(2))
    (tmp_path / "step_2" / layout.MANIFEST).write_text("{}")
    assert_state_equal(_load(tmp_path, "latest", make_state(1)), make_state(1))


def test_missing_name_raises_not_found(tmp_path: Path) -> None:
    _save(tmp_path, "step_1", make_state(1))
    with pytest.raises(CheckpointNotFoundError) as info:
        _load(tmp_path, "step_404", make_state(1))
    assert "step_404" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_empty_root_has_no_latest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        _load(tmp_path, "latest", make_state(1))


def test_a_directory_without_marker_is_not_a_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, "step_1", make_state(1))
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_2")
    os.remove(tmp_path / "step_2" / layout.COMMITTED_MARKER)
    with pytest.raises(CheckpointNotFoundError, match="_COMMITTED"):
        _load(tmp_path, "step_2", make_state(1))
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["step_1"]


def test_a_marker_that_names_another_manifest_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, "step_1", make_state(1))
    _save(tmp_path, "step_2", make_state(2))
    shutil.copy(tmp_path / "step_1" / layout.MANIFEST, tmp_path / "step_2" / layout.MANIFEST)
    with pytest.raises(CheckpointCorruptError) as info:
        _load(tmp_path, "step_2", make_state(2))
    assert info.value.expected != info.value.actual
    assert layout.MANIFEST in info.value.path


def test_invalid_name_is_refused_by_the_reader(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpointNameError):
        _load(tmp_path, "../etc", make_state(1))


def test_corrupt_item_names_file_item_and_checksums(tmp_path: Path) -> None:
    state = make_state(1)
    _save(tmp_path, "step_1", state)
    manifest = open_committed(open_backend(str(tmp_path)), "step_1").manifest
    victim = next(i for i in manifest.items if i.fqn == "f32")
    shard = tmp_path / "step_1" / victim.file
    data = bytearray(shard.read_bytes())
    data[victim.start + victim.length - 3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as info:
        _load(tmp_path, "step_1", state)
    error = info.value
    assert error.path.endswith(victim.file)
    assert error.item is not None and error.item.startswith("f32")
    assert error.expected == victim.checksum
    assert isinstance(error.actual, str) and error.actual != victim.checksum


def test_verify_off_still_checks_marker_and_metadata(tmp_path: Path) -> None:
    # DCP's metadata is read from the manifest (its plain form), which the marker's digest
    # covers: an edit to it without a new marker is refused, verify or not.
    _save(tmp_path, "step_1", make_state(1))
    manifest_path = tmp_path / "step_1" / layout.MANIFEST
    raw = json.loads(manifest_path.read_bytes())
    raw["dcp_metadata"]["entries"][0][1]["size"] = [1]
    manifest_path.write_bytes(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())
    reader = SafeStorageReader(tmp_path, verify=False)
    with pytest.raises(CheckpointCorruptError, match="manifest"):
        reader.reset("step_1")
