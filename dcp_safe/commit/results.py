"""The ranks' write results as the coordinator checks them, what each rank reports with them,
and DCP's ``.metadata`` from them.

The first write result's ``storage_data`` of a rank is a :class:`ReportedItem`: the item's
record and the rank's :class:`RankReport`, so rank 0 need not read every rank manifest back
(docs/architecture.md, "Phase one: every rank writes"). A rank with no items sends no report.
The report comes from the rank that wrote the manifest: as trustworthy as the stored copy.

Only the checks that need no storage (every planned item written once; a rank's records the
same as its manifest's); :mod:`dcp_safe.commit.committer` does the rest.
"""

from __future__ import annotations

import logging
import pickle
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from dcp_safe import layout
from dcp_safe.errors import CommitError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.dcp_metadata import encode_dcp_metadata
from dcp_safe.manifest.schema import FileRecord, ItemKey, ItemRecord, RankManifest, item_key
from dcp_safe.torch_compat import CURRENT_DCP_VERSION, StorageInfo

log = logging.getLogger(__name__)


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
    """``results`` with ``report`` carried by the first (unchanged when there is none). A first
    result that is no :class:`ItemRecord` is refused by :func:`records_by_rank`, typed."""
    if not results:
        return list(results)
    first = results[0]
    return [replace(first, storage_data=ReportedItem(first.storage_data, report)), *results[1:]]


def records_by_rank(
    results: list[list[WriteResult]],
) -> tuple[dict[int, list[ItemRecord]], dict[int, RankReport]]:
    """Each rank's item records, and the reports of the ranks that sent one."""
    per_rank: dict[int, list[ItemRecord]] = {}
    reports: dict[int, RankReport] = {}
    for rank, rank_results in enumerate(results):
        per_rank[rank] = []
        for result in rank_results:
            data = result.storage_data
            if isinstance(data, ReportedItem):
                reports[rank] = data.report
                data = data.record
            if not isinstance(data, ItemRecord):
                raise CommitError(
                    "a rank returned results SafeStorageWriter did not produce",
                    {rank: type(data).__name__},
                )
            per_rank[rank].append(data)
    return per_rank, reports


def check_every_item_written(metadata: Metadata, per_rank: Mapping[int, list[ItemRecord]]) -> None:
    written: dict[ItemKey, int] = {}
    for rank, records in per_rank.items():
        for record in records:
            if record.key in written:
                raise CommitError(
                    f"item {record.describe()} was written twice",
                    {rank: "duplicate", written[record.key]: "duplicate"},
                )
            written[record.key] = rank
    planned = [
        item_key(fqn, None if chunk is None else chunk.offsets)
        for fqn, entry in metadata.state_dict_metadata.items()
        for chunk in (entry.chunks if isinstance(entry, TensorStorageMetadata) else [None])
    ]
    if missing := [key for key in planned if key not in written]:
        shown = ", ".join(f"{fqn}@{offset}" for fqn, offset in missing[:5])
        raise CommitError(f"{len(missing)} planned items have no write result: {shown}")


def _fingerprints(records: Iterable[ItemRecord]) -> Iterator[tuple[Any, ...]]:
    return ((r.fqn, r.offset, r.file, r.start, r.length, r.checksum, r.blocks) for r in records)


def same_records(written: Sequence[ItemRecord], reported: Sequence[ItemRecord]) -> bool:
    """The same records, in any order (a rank writes them in its results' order: compared
    pairwise first, counted only if that fails)."""
    ours, theirs = list(_fingerprints(written)), list(_fingerprints(reported))
    return ours == theirs or Counter(ours) == Counter(theirs)


def dcp_metadata(
    metadata: Metadata,
    name: str,
    save_id: str,
    results: list[list[WriteResult]],
    per_rank: Mapping[int, list[ItemRecord]],
) -> tuple[bytes, dict[str, Any] | None]:
    """DCP's own ``.metadata`` (plain ``StorageInfo`` entries, so torch's readers load it), and
    the manifest's ``dcp_metadata``: what loads read instead of unpickling ``.metadata``.

    The latter is ``None``, with a warning, when the metadata holds what the plain form does
    not carry (the planner data of a custom planner): the checkpoint is still written, for
    torch's own readers; dcp_safe's readers refuse it, ``allow_pickle=True`` or not (they read
    ``.metadata`` without running its pickle, and a custom planner's data is not DCP's).
    """
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = {
        result.index: StorageInfo(
            relative_path=record.file,
            offset=record.start,
            length=record.length,
            transform_descriptors=list(record.transforms) or None,
        )
        for rank, rank_results in enumerate(results)
        for result, record in zip(rank_results, per_rank[rank], strict=True)
    }
    metadata.storage_meta = StorageMeta(checkpoint_id=name, save_id=save_id)
    try:
        plain = encode_dcp_metadata(metadata)
    except ValueError as exc:
        pickled = "dcp_safe's readers will refuse to load it"
        log.warning("checkpoint %s: DCP metadata has no plain form (%s); %s", name, exc, pickled)
        plain = None
    return pickle.dumps(metadata), plain
