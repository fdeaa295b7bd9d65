"""SafeStorageWriter: round trips, torch compatibility, bad input, and failed saves."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import assert_state_equal, blank_like, make_state
from torch.distributed.checkpoint import FileSystemReader

import dcp_safe
from dcp_safe import (
    CommitError,
    ConfigError,
    SafeStorageReader,
    SafeStorageWriter,
    StorageError,
    Topology,
    WriterOptions,
    layout,
)
from dcp_safe.adapters.node_local import NodeLocalWriter, writer_for
from dcp_safe.adapters.options import WRITER_MOVED
from dcp_safe.errors import CheckpointExistsError, InvalidCheckpointNameError


def _save(root: Path, name: str, state: dict[str, Any], **kwargs: Any) -> None:
    dcp_safe.save(state, checkpoint_id=name, storage_writer=SafeStorageWriter(root, **kwargs))


def _load(root: Path, name: str, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root))
    return target


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256", "crc32"])
def test_round_trip_is_exact_for_every_dtype_and_layout(
    tmp_path: Path, state: dict[str, Any], compression: str, checksum: str
) -> None:
    options = WriterOptions(compression=compression, checksum=checksum)
    _save(tmp_path, "step_1", state, options=options)
    assert_state_equal(_load(tmp_path, "step_1", state), state)


def test_several_writer_threads_split_items_over_files(tmp_path: Path) -> None:
    state = make_state(3)
    _save(tmp_path, "step_1", state, options=WriterOptions(thread_count=3))
    shards = [p for p in os.listdir(tmp_path / "step_1") if p.endswith(layout.SHARD_SUFFIX)]
    assert len(shards) == 3
    assert_state_equal(_load(tmp_path, "step_1", state), state)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_torch_own_reader_loads_our_checkpoint(
    tmp_path: Path, state: dict[str, Any], compression: str
) -> None:
    _save(tmp_path, "step_1", state, options=WriterOptions(compression=compression))
    target = blank_like(state)
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "step_1"), no_dist=True)
    assert_state_equal(target, state)
    target = blank_like(state)
    dcp.load(target, checkpoint_id=str(tmp_path / "step_1"), no_dist=True)
    assert_state_equal(target, state)


def test_zstd_shrinks_compressible_state(tmp_path: Path) -> None:
    state = {"zeros": torch.zeros(256, 1024)}
    _save(tmp_path, "plain", state)
    _save(tmp_path, "packed", state, options=WriterOptions(compression="zstd"))
    plain = dcp_safe.list_checkpoints(tmp_path)[0].size_bytes
    packed = dcp_safe.list_checkpoints(tmp_path)[1].size_bytes
    assert packed * 20 < plain


def test_async_save_in_a_thread_commits(tmp_path: Path, state: dict[str, Any]) -> None:
    future = dcp_safe.async_save(
        state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path)
    )
    future.result(timeout=120)
    assert_state_equal(_load(tmp_path, "step_1", state), state)


def test_layout_has_marker_manifest_metadata_and_rank_manifest(
    tmp_path: Path, state: dict[str, Any]
) -> None:
    _save(tmp_path, "step_1", state)
    entries = set(os.listdir(tmp_path / "step_1"))
    assert {layout.COMMITTED_MARKER, layout.MANIFEST, layout.DCP_METADATA} <= entries
    assert (tmp_path / "step_1" / layout.rank_manifest_name(0)).is_file()
    assert os.listdir(tmp_path) == ["step_1"]  # no partial directory left behind


@pytest.mark.parametrize("name", ["", "a/b", "..", "x..y", ".hidden", "latest", "sp ace"])
def test_bad_names_are_refused_before_anything_is_written(
    tmp_path: Path, state: dict[str, Any], name: str
) -> None:
    with pytest.raises(InvalidCheckpointNameError):
        _save(tmp_path / "root", name, state)
    assert not (tmp_path / "root").exists()


def test_saving_to_a_committed_name_is_refused(tmp_path: Path, state: dict[str, Any]) -> None:
    _save(tmp_path, "step_1", state)
    with pytest.raises(CheckpointExistsError) as info:
        _save(tmp_path, "step_1", make_state(1))
    assert str(tmp_path / "step_1") in str(info.value)
    assert_state_equal(_load(tmp_path, "step_1", state), state)


def test_overwrite_replaces_a_committed_checkpoint_atomically(tmp_path: Path) -> None:
    old, new = make_state(1), make_state(2)
    _save(tmp_path, "step_1", old)
    _save(tmp_path, "step_1", new, options=WriterOptions(overwrite=True))
    assert_state_equal(_load(tmp_path, "step_1", new), new)
    assert os.listdir(tmp_path) == ["step_1"]
    dcp_safe.verify_checkpoint(tmp_path, "step_1")


def test_unwritable_root_raises_storage_error_naming_the_path(
    tmp_path: Path, state: dict[str, Any]
) -> None:
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_bytes(b"not a directory")
        root = blocker / "root"  # root can write anywhere, but not under a regular file
    else:
        root = tmp_path / "locked"
        root.mkdir()
        root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(StorageError) as info:
        _save(root, "step_1", state)
    assert str(root) in str(info.value)


def test_bad_options_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="compression"):
        SafeStorageWriter(tmp_path, options=WriterOptions(compression="lz4"))
    with pytest.raises(ConfigError, match="checksum"):
        SafeStorageWriter(tmp_path, options=WriterOptions(checksum="md5"))
    with pytest.raises(ConfigError, match="thread_count"):
        SafeStorageWriter(tmp_path, options=WriterOptions(thread_count=0))


def test_writer_options_set_how_the_writer_writes(tmp_path: Path, state: dict[str, Any]) -> None:
    options = WriterOptions(compression="zstd", thread_count=2, fsync=False)
    writer = SafeStorageWriter(tmp_path, options=options)
    assert writer.options == options
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)
    assert_state_equal(_load(tmp_path, "step_1", state), state)
    with pytest.raises(ConfigError, match="WriterOptions"):
        SafeStorageWriter(tmp_path, options={"compression": "zstd"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compresion"):
        SafeStorageWriter(tmp_path, compresion="zstd")


@pytest.mark.parametrize("keyword", sorted(WRITER_MOVED))
def test_a_keyword_that_moved_into_writer_options_names_its_place(
    tmp_path: Path, keyword: str
) -> None:
    value = getattr(WriterOptions(), keyword)  # any value: the keyword itself is refused
    moved = re.escape(f"moved to options=WriterOptions({keyword}=...)")
    with pytest.raises(ConfigError, match=moved):
        SafeStorageWriter(tmp_path, **{keyword: value})
    with pytest.raises(ConfigError, match=moved):
        NodeLocalWriter(tmp_path / "node", remote=tmp_path / "remote", **{keyword: value})
    with pytest.raises(ConfigError, match=moved):
        writer_for(Topology.of(tmp_path), **{keyword: value})


def test_a_topology_root_is_the_writers_own(tmp_path: Path) -> None:
    topology = Topology.of(tmp_path / "local", replicate_to=tmp_path / "remote")
    writer = SafeStorageWriter(topology)
    assert writer.topology is topology
    assert (writer.root, writer.replicate_to) == (str(tmp_path / "local"), str(tmp_path / "remote"))
    assert writer.remote is not None
    for roots in ({"replicate_to": tmp_path / "r"}, {"storage_options": {}}):
        with pytest.raises(ConfigError, match=r"Topology\.of"):
            SafeStorageWriter(topology, **roots)


class _FailingWriter(SafeStorageWriter):
    """Fails in the named phase, after the real work of that phase has started."""

    def __init__(self, root: Path, phase: str) -> None:
        super().__init__(root)
        self.phase = phase

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.phase == "write_data":
            raise OSError(28, "No space left on device (injected)")
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        if self.phase == "finish":
            original = self.backend.write_bytes

            def fail_on_marker(rel: str, data: bytes, *, exclusive: bool = False) -> None:
                if rel.endswith(layout.COMMITTED_MARKER):
                    raise StorageError("write", rel, "injected failure")
                original(rel, data, exclusive=exclusive)

            self.backend.write_bytes = fail_on_marker  # type: ignore[method-assign]
        super().finish(metadata, results)


@pytest.mark.parametrize("phase", ["write_data", "finish"])
def test_failed_save_publishes_nothing_and_keeps_the_previous(tmp_path: Path, phase: str) -> None:
    good = make_state(1)
    _save(tmp_path, "step_1", good)
    with pytest.raises((CommitError, StorageError, OSError)):
        dcp_safe.save(
            make_state(2), checkpoint_id="step_2", storage_writer=_FailingWriter(tmp_path, phase)
        )
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["step_1"]
    assert not (tmp_path / "step_2").exists()
    assert_state_equal(_load(tmp_path, "latest", good), good)
    _save(tmp_path, "step_2", make_state(2))  # the next save is not blocked by leftovers
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["step_1", "step_2"]


def test_failure_in_finish_removes_the_partial_directory(tmp_path: Path) -> None:
    with pytest.raises(StorageError):
        dcp_safe.save(
            make_state(1), checkpoint_id="step_1", storage_writer=_FailingWriter(tmp_path, "finish")
        )
    assert os.listdir(tmp_path) == []


def test_writer_survives_pickling_for_the_process_executor(tmp_path: Path) -> None:
    import pickle

    writer = SafeStorageWriter(tmp_path, options=WriterOptions(compression="zstd"))
    clone = pickle.loads(pickle.dumps(writer))
    dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=clone)
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["step_1"]


def test_manifest_records_versions_world_size_and_step(tmp_path: Path) -> None:
    _save(tmp_path, "step_7", make_state(1), step=7)
    info = dcp_safe.list_checkpoints(tmp_path)[0]
    assert (info.name, info.step, info.world_size) == ("step_7", 7, 1)
    manifest = (tmp_path / "step_7" / layout.MANIFEST).read_text()
    assert torch.__version__ in manifest and dcp_safe.__version__ in manifest


_FAIL_MID_TENSOR = """
import gc, sys, torch, dcp_safe
from dcp_safe import SafeStorageWriter
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
faults = FaultInjector(FaultPlan(fail_at=5, ops=("write",)))
writer = SafeStorageWriter(
    "faulty://" + sys.argv[1],
    storage_options={"target_protocol": "file", "faults": faults},
)
try:
    dcp_safe.save({"w": torch.zeros(1024, 1024)}, checkpoint_id="s1", storage_writer=writer)
except dcp_safe.StorageError:
    print("storage error")
gc.collect()
print("collected")
"""


@pytest.mark.multiproc
def test_a_write_failing_mid_tensor_raises_and_leaves_the_process_healthy(tmp_path: Path) -> None:
    # torch's zip writer finishes itself in its C++ destructor if nobody did; after a failed
    # write that throws inside the destructor and aborts the interpreter, so it runs apart.
    done = subprocess.run(
        [sys.executable, "-c", _FAIL_MID_TENSOR, str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["storage", "error", "collected"]
    assert dcp_safe.list_checkpoints(tmp_path / "root") == []
