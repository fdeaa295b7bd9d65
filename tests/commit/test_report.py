"""Rank reports: what a rank hands the coordinator about its manifest, beside its results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

import dcp_safe
from dcp_safe import SafeStorageWriter, layout
from dcp_safe.commit.results import ReportedItem, attach_report, records_by_rank, report_for
from dcp_safe.errors import CommitError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest, RankManifest


def _record(fqn: str) -> ItemRecord:
    return ItemRecord(
        fqn=fqn, offset=None, file="__0_0.distcp", start=0, length=4, checksum="crc32:00000000"
    )


def _result(fqn: str) -> WriteResult:
    return WriteResult(index=MetadataIndex(fqn), size_in_bytes=4, storage_data=_record(fqn))


def _manifest() -> RankManifest:
    return RankManifest(
        name="step_1",
        save_id="s1",
        rank=3,
        checksum_algorithm="xxh3_128",
        files=(FileRecord(path="__3_0.distcp", size=4),),
        items=(_record("a"),),
    )


def test_a_report_names_the_manifest_as_written() -> None:
    manifest = _manifest()
    written = manifest.to_json()
    report = report_for(manifest, written, ChecksumAlgorithm.XXH3_128)
    assert (report.name, report.save_id, report.rank, report.files) == (
        "step_1",
        "s1",
        3,
        manifest.files,
    )
    assert report.manifest == FileRecord(
        path=layout.rank_manifest_name(3),
        size=len(written),
        checksum=digest_bytes(written, ChecksumAlgorithm.XXH3_128),
    )


def test_the_first_result_carries_the_report_and_the_rest_are_unchanged() -> None:
    results = [_result("a"), _result("b")]
    report = report_for(_manifest(), b"{}", ChecksumAlgorithm.XXH3_128)
    carried = attach_report(results, report)
    assert carried[0].storage_data == ReportedItem(results[0].storage_data, report)
    assert (carried[0].index, carried[0].size_in_bytes) == (results[0].index, 4)
    assert carried[1] is results[1]
    assert attach_report([], report) == []


def test_a_result_the_writer_did_not_produce_is_refused() -> None:
    foreign = WriteResult(index=MetadataIndex("a"), size_in_bytes=4, storage_data="not ours")
    carried = attach_report([foreign], report_for(_manifest(), b"{}", ChecksumAlgorithm.XXH3_128))
    with pytest.raises(CommitError, match="did not produce") as caught:
        records_by_rank([carried])
    assert caught.value.failures == {0: "str"}


class _Capturing(SafeStorageWriter):
    """Keeps the results DCP hands ``finish``."""

    results: list[list[WriteResult]]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.results = results
        super().finish(metadata, results)


def test_a_real_save_reports_exactly_the_stored_rank_manifest(tmp_path: Path) -> None:
    state: dict[str, Any] = {"w": torch.arange(64.0), "b": torch.ones(3), "step": 7}
    writer = _Capturing(tmp_path)
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)
    [rank_results] = writer.results
    first = rank_results[0].storage_data
    assert isinstance(first, ReportedItem)
    assert all(isinstance(r.storage_data, ItemRecord) for r in rank_results[1:])
    report = first.report
    stored = (tmp_path / "step_1" / report.manifest.path).read_bytes()
    manifest = RankManifest.from_json(stored, "stored")
    assert report.manifest.size == len(stored)
    assert report.manifest.checksum == digest_bytes(stored, ChecksumAlgorithm.XXH3_128)
    assert report.files == manifest.files
    assert (report.name, report.rank) == ("step_1", 0)
    # The global manifest records the reported rank manifest, and the checkpoint verifies.
    committed = Manifest.from_json((tmp_path / "step_1" / layout.MANIFEST).read_bytes(), "m")
    assert report.manifest in committed.files
    dcp_safe.verify_checkpoint(tmp_path, "step_1")
