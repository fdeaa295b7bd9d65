"""The coordinator's verify-and-publish: parallel checks with typed errors, durable ordering.

Saves of several ranks are laid down with the world-size simulation ``dcp_safe.testing.world``
(what ``benchmarks/bench_coordinator.py`` times: real files, the writer's own types), so a dozen
ranks cost no process group.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.storage import WriteResult

import dcp_safe
from dcp_safe import CommitError, ConfigError, StorageError, layout
from dcp_safe.adapters.options import WriterOptions
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.commit.committer import MAX_COMMIT_WORKERS, Committer
from dcp_safe.commit.results import ReportedItem
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.schema import FileRecord, RankManifest
from dcp_safe.testing import world

RANKS = 12


@pytest.mark.parametrize("workers", [0, -1, MAX_COMMIT_WORKERS + 1, True, 2.0, "4"])
def test_a_worker_count_out_of_range_is_refused(tmp_path: Path, workers: Any) -> None:
    with pytest.raises(ConfigError, match="workers"):
        Committer(LocalBackend(str(tmp_path)), WriterOptions(), workers=workers)


@pytest.mark.parametrize("workers", [1, 3, 16])
def test_any_worker_count_publishes_the_same_checkpoint(tmp_path: Path, workers: int) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    manifest = world.publish(backend, save, workers=workers)
    assert [f.path for f in manifest.files[:RANKS]] == [
        layout.shard_file_name(r, 0) for r in range(RANKS)
    ]
    assert [i.offset for i in manifest.items][:: world.ITEMS_PER_RANK] == [
        (r * world.ROWS_PER_RANK, 0) for r in range(RANKS)
    ]
    dcp_safe.verify_checkpoint(tmp_path, "step_1")


def _assert_nothing_published(root: Path) -> None:
    assert sorted(os.listdir(root)) == []  # the partial directory is gone too


def test_missing_rank_manifests_fail_naming_the_lowest_rank(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    for rank in (9, 5):
        backend.remove_file(f"{save.work_dir}/{layout.rank_manifest_name(rank)}")
    with pytest.raises(CommitError, match="missing or unreadable") as caught:
        world.publish(backend, save, workers=4)
    assert list(caught.value.failures) == [5]
    _assert_nothing_published(tmp_path)


def test_a_truncated_shard_fails_naming_its_rank_and_sizes(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    shard = tmp_path / save.work_dir / layout.shard_file_name(7, 0)
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CommitError, match="not the size its items add up to") as caught:
        world.publish(backend, save, workers=4)
    assert list(caught.value.failures) == [7]
    assert "on storage" in caught.value.failures[7]
    _assert_nothing_published(tmp_path)


def test_a_missing_shard_is_a_commit_error_not_a_bare_os_error(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    backend.remove_file(f"{save.work_dir}/{layout.shard_file_name(3, 0)}")
    with pytest.raises(CommitError, match="a shard file is missing") as caught:
        world.publish(backend, save, workers=4)
    assert list(caught.value.failures) == [3]
    _assert_nothing_published(tmp_path)


def _without_reports(save: world.SimulatedSave, ranks: Iterable[int]) -> world.SimulatedSave:
    """``save`` as if ``ranks`` had sent no report (as a rank that wrote no items cannot)."""
    stripped = set(ranks)

    def plain(result: WriteResult) -> WriteResult:
        data = result.storage_data
        record = data.record if isinstance(data, ReportedItem) else data
        return dataclasses.replace(result, storage_data=record)

    results = [
        [plain(r) for r in rank_results] if rank in stripped else rank_results
        for rank, rank_results in enumerate(save.results)
    ]
    return dataclasses.replace(save, results=results)


def _change_first_checksum(backend: LocalBackend, rel: str) -> None:
    manifest = RankManifest.from_json(backend.read_bytes(rel), rel)
    item = dataclasses.replace(manifest.items[0], checksum="crc32:00000000")
    changed = dataclasses.replace(manifest, items=(item, *manifest.items[1:]))
    backend.write_bytes(rel, changed.to_json())


def test_a_rank_manifest_changed_on_storage_after_its_rank_wrote_it_fails(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    _change_first_checksum(backend, f"{save.work_dir}/{layout.rank_manifest_name(4)}")
    with pytest.raises(CommitError, match="not the one its rank wrote") as caught:
        world.publish(backend, save, workers=4)
    assert list(caught.value.failures) == [4]
    assert "on storage" in caught.value.failures[4]
    _assert_nothing_published(tmp_path)


def test_a_rank_without_a_report_has_its_manifest_read_back_and_compared(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(str(tmp_path))
    save = _without_reports(world.simulate(backend, "step_1", RANKS), [4, 8])
    _change_first_checksum(backend, f"{save.work_dir}/{layout.rank_manifest_name(4)}")
    with pytest.raises(CommitError, match="disagrees with the rank's write results") as caught:
        world.publish(backend, save, workers=4)
    assert list(caught.value.failures) == [4]
    _assert_nothing_published(tmp_path)


@pytest.mark.parametrize("workers", [1, 4])
def test_reported_and_read_back_ranks_publish_the_same_checkpoint(
    tmp_path: Path, workers: int
) -> None:
    reported, read_back = LocalBackend(str(tmp_path / "a")), LocalBackend(str(tmp_path / "b"))
    save = world.simulate(reported, "step_1", RANKS)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    first = world.publish(reported, save, workers=workers)
    second = world.publish(read_back, _without_reports(save, range(0, RANKS, 2)), workers=workers)
    assert first.files == second.files
    assert first.items == second.items
    dcp_safe.verify_checkpoint(tmp_path / "b", "step_1")


def _with_report(save: world.SimulatedSave, of_rank: int, **changes: Any) -> world.SimulatedSave:
    """``save`` with fields of rank ``of_rank``'s report replaced."""
    first, *rest = save.results[of_rank]
    data = first.storage_data
    assert isinstance(data, ReportedItem)
    report = dataclasses.replace(data.report, **changes)
    carried = dataclasses.replace(first, storage_data=ReportedItem(data.record, report))
    results = list(save.results)
    results[of_rank] = [carried, *rest]
    return dataclasses.replace(save, results=results)


@pytest.mark.parametrize("changes", [{"save_id": "another"}, {"rank": 2}, {"name": "step_2"}])
def test_a_report_of_another_save_or_rank_fails(tmp_path: Path, changes: dict[str, Any]) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    with pytest.raises(CommitError, match="belongs to another save") as caught:
        world.publish(backend, _with_report(save, 6, **changes), workers=4)
    assert list(caught.value.failures) == [6]
    _assert_nothing_published(tmp_path)


def test_a_rank_checksumming_with_another_algorithm_fails(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    rel = layout.rank_manifest_name(3)
    raw = backend.read_bytes(f"{save.work_dir}/{rel}")
    crc = FileRecord(path=rel, size=len(raw), checksum=digest_bytes(raw, ChecksumAlgorithm.CRC32))
    with pytest.raises(CommitError, match="another algorithm") as caught:
        world.publish(backend, _with_report(save, 3, manifest=crc), workers=4)
    assert caught.value.failures == {3: "crc32"}
    _assert_nothing_published(tmp_path)


def test_items_in_a_file_the_report_does_not_list_fail(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    with pytest.raises(CommitError, match="does not list") as caught:
        world.publish(backend, _with_report(save, 9, files=()), workers=4)
    assert caught.value.failures == {9: layout.shard_file_name(9, 0)}
    _assert_nothing_published(tmp_path)


class _FailingStat(LocalBackend):
    """A storage fault on one shard's size, from a worker thread: on its own, and on the
    listing of the folder that holds it (where the committer sizes shards from)."""

    def __init__(self, root: str, failing: str) -> None:
        super().__init__(root)
        self.failing = failing

    def size(self, rel: str) -> int:
        if rel.endswith(self.failing):
            raise StorageError("stat", rel, "injected")
        return super().size(rel)

    def sizes(self, rel: str) -> dict[str, int]:
        found = super().sizes(rel)
        if self.failing in found:
            raise StorageError("list", rel, "injected")
        return found


def test_a_storage_error_in_a_worker_reaches_the_caller_typed(tmp_path: Path) -> None:
    backend = _FailingStat(str(tmp_path), layout.shard_file_name(6, 0))
    save = world.simulate(backend, "step_1", RANKS)
    with pytest.raises(StorageError, match="injected"):
        world.publish(backend, save, workers=4)
    _assert_nothing_published(tmp_path)


class _Recording(LocalBackend):
    """Records, in order, each completed write, fsync and rename (from any thread)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.events: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _record(self, op: str, rel: str) -> None:
        with self._lock:
            self.events.append((op, rel))

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        super().write_bytes(rel, data, exclusive=exclusive)
        self._record("write", rel)

    def sync_dir(self, rel: str) -> None:
        super().sync_dir(rel)
        self._record("sync_dir", rel)

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        parked = super().publish_dir(src, dst, replace=replace)
        self._record("rename", dst)
        return parked


def test_every_file_and_entry_is_durable_before_the_rename(tmp_path: Path) -> None:
    """The control files and the marker are written (each fsynced) at once, but all of them,
    and the fsync of the folders holding them, complete before the rename; the parent's fsync
    after it, before publish returns."""
    backend = _Recording(str(tmp_path))
    save = world.simulate(backend, "step_1", 3)
    backend.events.clear()
    world.publish(backend, save)
    work = save.work_dir
    events = backend.events
    rename = events.index(("rename", "step_1"))
    before = set(events[:rename])
    for control in (layout.DCP_METADATA, layout.MANIFEST, layout.COMMITTED_MARKER):
        assert ("write", f"{work}/{control}") in before
    assert ("sync_dir", f"{work}/{layout.RANKS_DIR}") in before
    work_sync = events.index(("sync_dir", work))
    assert work_sync < rename
    assert all(events.index(("write", f"{work}/{c}")) < work_sync for c in (layout.MANIFEST,))
    assert events[rename + 1 :] == [("sync_dir", "")]


def test_on_a_marker_root_the_marker_comes_after_every_control_file(memory_root: str) -> None:
    from dcp_safe.backends.roots import open_backend

    backend = open_backend(memory_root)
    save = world.simulate(backend, "step_1", 3)
    written: list[str] = []
    original = backend.write_bytes

    def record(rel: str, data: bytes, *, exclusive: bool = False) -> None:
        original(rel, data, exclusive=exclusive)
        written.append(rel.rsplit("/", 1)[-1])

    backend.write_bytes = record  # type: ignore[method-assign]
    world.publish(backend, save)
    assert written[-1] == layout.COMMITTED_MARKER
    assert set(written[:-1]) == {layout.DCP_METADATA, layout.MANIFEST}
    dcp_safe.verify_checkpoint(memory_root, "step_1")


class _Counting(LocalBackend):
    """Counts size and listing calls; ``hide`` drops names from listings (a stale listing)."""

    def __init__(self, root: str, hide: frozenset[str] = frozenset()) -> None:
        super().__init__(root)
        self.hide = hide
        self.sized: list[str] = []
        self.listed: list[str] = []
        self.read: list[str] = []
        self._lock = threading.Lock()

    def size(self, rel: str) -> int:
        with self._lock:
            self.sized.append(rel)
        return super().size(rel)

    def sizes(self, rel: str) -> dict[str, int]:
        with self._lock:
            self.listed.append(rel)
        return {k: v for k, v in super().sizes(rel).items() if k not in self.hide}

    def read_small(self, rel: str, limit: int) -> bytes:
        with self._lock:
            self.read.append(rel)
        return super().read_small(rel, limit)


@pytest.mark.parametrize("workers", [1, 4])
def test_two_listings_check_every_file_and_no_rank_manifest_is_read_back(
    tmp_path: Path, workers: int
) -> None:
    """One listing of the work folder sizes the shards, one of ``_ranks/`` the rank manifests
    (whose contents the ranks reported): a request per 1,000 ranks on an object store."""
    backend = _Counting(str(tmp_path))
    save = world.simulate(backend, "step_1", RANKS)
    world.publish(backend, save, workers=workers)
    assert sorted(backend.listed) == [save.work_dir, f"{save.work_dir}/{layout.RANKS_DIR}"]
    assert backend.sized == []
    assert not [rel for rel in backend.read if "/" + layout.RANKS_DIR + "/" in rel]
    dcp_safe.verify_checkpoint(tmp_path, "step_1")


@pytest.mark.parametrize("rel", [layout.shard_file_name(5, 0), layout.rank_manifest_name(5)])
def test_a_file_a_listing_missed_is_asked_for_on_its_own(tmp_path: Path, rel: str) -> None:
    backend = _Counting(str(tmp_path), hide=frozenset({rel.rpartition("/")[2]}))
    save = world.simulate(backend, "step_1", RANKS)
    world.publish(backend, save, workers=4)
    assert backend.sized == [f"{save.work_dir}/{rel}"]
    dcp_safe.verify_checkpoint(tmp_path, "step_1")
