"""What a rank tells the coordinator about its rank manifest, beside its write results.

The first write result's ``storage_data`` is a :class:`ReportedItem`: the item's record and the
rank's :class:`RankReport`, so rank 0 need not read every rank manifest back
(docs/architecture.md, "Phase one: every rank writes"). A rank with no items sends no report.
The report comes from the rank that wrote the manifest: as trustworthy as the stored copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.checkpoint.storage import WriteResult

from dcp_safe import layout
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.schema import FileRecord, ItemRecord, RankManifest

__all__ = ["RankReport", "ReportedItem", "attach_report", "report_for"]


@dataclass(frozen=True)
class RankReport:
    """One rank's manifest as the coordinator needs it: whose it is, its files, its own record."""

    name: str
    save_id: str
    rank: int
    files: tuple[FileRecord, ...]
    #: The rank manifest as written: its path in the checkpoint, size and checksum.
    manifest: FileRecord


@dataclass(frozen=True)
class ReportedItem:
    """The ``storage_data`` of a rank's first write result: the item's record, and the report."""

    record: ItemRecord
    report: RankReport


def report_for(manifest: RankManifest, written: bytes, algorithm: ChecksumAlgorithm) -> RankReport:
    """The report of ``manifest``, whose stored bytes are ``written``."""
    return RankReport(
        name=manifest.name,
        save_id=manifest.save_id,
        rank=manifest.rank,
        files=manifest.files,
        manifest=FileRecord(
            path=layout.rank_manifest_name(manifest.rank),
            size=len(written),
            checksum=digest_bytes(written, algorithm),
        ),
    )


def attach_report(results: Sequence[WriteResult], report: RankReport) -> list[WriteResult]:
    """``results`` with ``report`` carried by the first (unchanged when there is none)."""
    if not results:
        return list(results)
    first = results[0]
    if not isinstance(first.storage_data, ItemRecord):
        raise TypeError(f"expected an ItemRecord, got {type(first.storage_data).__name__}")
    carried = WriteResult(
        index=first.index,
        size_in_bytes=first.size_in_bytes,
        storage_data=ReportedItem(first.storage_data, report),
    )
    return [carried, *results[1:]]
