"""``verify_checkpoint``'s quick mode (``deep=False``) against real checkpoints on a local root.

The deep mode is covered by tests/e2e/test_corruption.py; here: what the quick check catches,
what it deliberately does not read, and what its report says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_state, resign_manifest

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    SafeStorageWriter,
    WriterOptions,
    layout,
    list_checkpoints,
    verify_checkpoint,
)
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed, resolve_name
from dcp_safe.manifest.schema import FileRecord
from dcp_safe.testing import world


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A local root holding the committed checkpoint step_0001."""
    writer = SafeStorageWriter(tmp_path, options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(make_state(1), checkpoint_id="step_0001", storage_writer=writer)
    return tmp_path


def _shard(root: Path) -> Path:
    (shard,) = sorted((root / "step_0001").glob(f"*{layout.SHARD_SUFFIX}"))
    return shard


def _files(root: Path) -> tuple[FileRecord, ...]:
    return open_committed(open_backend(str(root), None), "step_0001").manifest.files


def test_quick_verify_checks_every_file_and_reads_no_bytes(root: Path) -> None:
    seen: list[FileRecord] = []
    report = verify_checkpoint(root, "latest", deep=False, progress=seen.append)
    assert report.name == "step_0001"
    assert report.files_checked == len(_files(root)) > 0
    assert (report.bytes_read, report.items_checked) == (0, 0)
    assert seen == list(_files(root))


def test_deep_verify_reports_every_byte_it_read(root: Path) -> None:
    report = verify_checkpoint(root, "step_0001")
    assert report.bytes_read == sum(record.size for record in _files(root)) > 0
    assert report.items_checked > 0


def test_quick_verify_names_a_truncated_file_with_both_sizes(root: Path) -> None:
    shard = _shard(root)
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CheckpointCorruptError, match="size differs") as caught:
        verify_checkpoint(root, "step_0001", deep=False)
    assert shard.name in str(caught.value)
    assert (caught.value.expected, caught.value.actual) == (len(data), len(data) - 10)


def test_quick_verify_names_a_missing_file(root: Path) -> None:
    shard = _shard(root)
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match="missing") as caught:
        verify_checkpoint(root, "step_0001", deep=False)
    assert shard.name in str(caught.value)


def test_quick_verify_passes_a_flipped_byte_that_deep_verify_catches(root: Path) -> None:
    shard = _shard(root)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(root, "step_0001", deep=False).files_checked > 0
    with pytest.raises(CheckpointCorruptError):
        verify_checkpoint(root, "step_0001")


def test_latest_is_the_highest_step_whatever_the_commit_clock_says(tmp_path: Path) -> None:
    """Commit times come from each writer's clock; a later commit of an earlier step (a node
    with a fast clock, a late retry) must not become "latest"."""
    for step in (2, 1):  # step 1 commits last
        writer = SafeStorageWriter(tmp_path, step=step)
        dcp_safe.save({"w": torch.ones(2)}, checkpoint_id=f"step_{step}", storage_writer=writer)

    assert resolve_name(open_backend(str(tmp_path)), "latest") == "step_2"
    assert [i.name for i in list_checkpoints(tmp_path)] == ["step_1", "step_2"]


def test_a_manifest_pointing_outside_its_checkpoint_is_refused_and_hides_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    for step in (1, 2):
        writer = SafeStorageWriter(root, step=step)
        dcp_safe.save({"w": torch.ones(2)}, checkpoint_id=f"step_{step}", storage_writer=writer)

    def point_outside(raw: dict[str, Any]) -> None:
        raw["files"].append({"path": "../../secret.bin", "size": 9, "checksum": None})

    resign_manifest(root, "step_2", point_outside)

    with pytest.raises(CheckpointCorruptError, match="not a file of the checkpoint"):
        verify_checkpoint(root, "step_2")
    assert [i.name for i in list_checkpoints(root)] == ["step_1"]  # the good one still listed
    assert verify_checkpoint(root, "latest").name == "step_1"
    assert secret.read_bytes() == b"not yours"


class _CountingCalls:
    """Counts the size and listing calls of every ``LocalBackend`` while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hide: str | None = None) -> None:
        self.sized: list[str] = []
        self.listed: list[str] = []
        size, sizes = LocalBackend.size, LocalBackend.sizes

        def counted_size(backend: LocalBackend, rel: str) -> int:
            self.sized.append(rel)
            return size(backend, rel)

        def counted_sizes(backend: LocalBackend, rel: str) -> dict[str, int]:
            self.listed.append(rel)
            return {k: v for k, v in sizes(backend, rel).items() if k != hide}

        monkeypatch.setattr(LocalBackend, "size", counted_size)
        monkeypatch.setattr(LocalBackend, "sizes", counted_sizes)


def _many_ranks(tmp_path: Path, ranks: int) -> None:
    backend = LocalBackend(str(tmp_path))
    world.publish(backend, world.simulate(backend, "step_1", ranks))


def test_quick_verify_sizes_every_file_from_one_listing_per_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _many_ranks(tmp_path, 12)
    calls = _CountingCalls(monkeypatch)
    report = verify_checkpoint(tmp_path, "step_1", deep=False)
    assert report.files_checked == 12 * 2 + 1  # a shard and a rank manifest each, .metadata
    assert sorted(calls.listed) == ["step_1", f"step_1/{layout.RANKS_DIR}"]
    assert calls.sized == []


def test_quick_verify_asks_for_a_file_its_listing_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _many_ranks(tmp_path, 12)
    shard = layout.shard_file_name(7, 0)
    calls = _CountingCalls(monkeypatch, hide=shard)
    verify_checkpoint(tmp_path, "step_1", deep=False)
    assert calls.sized == [f"step_1/{shard}"]


def test_quick_verify_names_a_changed_rank_manifest_with_both_sizes(tmp_path: Path) -> None:
    _many_ranks(tmp_path, 12)
    rank_manifest = tmp_path / "step_1" / layout.rank_manifest_name(5)
    data = rank_manifest.read_bytes()
    rank_manifest.write_bytes(data + b" ")
    with pytest.raises(CheckpointCorruptError, match="size differs") as caught:
        verify_checkpoint(tmp_path, "step_1", deep=False)
    assert rank_manifest.name in str(caught.value)
    assert (caught.value.expected, caught.value.actual) == (len(data), len(data) + 1)
