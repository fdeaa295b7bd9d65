"""What a rank tells the coordinator about its rank manifest, beside its write results.

Each rank writes its rank manifest (``_ranks/rank_NNNNN.json``) to storage and returns its
write results to DCP, which gathers them to rank 0 for ``finish``. Reading thousands of rank
manifests back from storage made the commit cost one request per rank: at 4,096 ranks on an
object store that was most of a minute (#18). So the rank also hands the coordinator what the
commit needs of its manifest — its files, and the manifest's own size and checksum — through the
same gather: the first write result's ``storage_data`` is a :class:`ReportedItem` holding the
item's record and the rank's :class:`RankReport`. The coordinator then proves each manifest is on
storage with the size the rank wrote from one listing of ``_ranks/`` (a request per 1,000 ranks on
an object store), just as it sizes the shards; it reads a manifest back only for a rank that sent
no report (a rank that wrote no items has no result to carry one).

The report travels over the process group, from the rank that wrote the manifest: it is at least
as trustworthy as the stored copy, and the global manifest records the checksum of the bytes the
rank wrote, so a manifest changed on storage afterwards fails verification.
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
