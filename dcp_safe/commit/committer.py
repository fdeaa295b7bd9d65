"""The coordinator's verify-and-publish: docs/architecture.md, "Phase two: rank 0 verifies and
publishes". Runs on rank 0 in ``SafeStorageWriter.finish`` and ``NodeLocalWriter``'s remote commit.

Its storage calls are a few listings, not one per rank or file: manifests are checked from the
ranks' reports (:mod:`dcp_safe.commit.results`) and one listing of ``_ranks/``, shards from one
listing of the work folder, on a bounded pool (``workers``). A worker's error is raised here,
typed, the lowest failing rank first.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.listed_sizes import ListedSizes
from dcp_safe.choices import require_int
from dcp_safe.commit.results import (
    RankReport,
    check_every_item_written,
    dcp_metadata,
    records_by_rank,
    report_for,
    same_records,
)
from dcp_safe.commit.strategy import Publication
from dcp_safe.errors import CheckpointExistsError, CommitError, DcpSafeError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest, RankManifest
from dcp_safe.version import __version__

log = logging.getLogger(__name__)

#: Storage calls the coordinator keeps in flight while it checks the ranks' outputs.
DEFAULT_COMMIT_WORKERS = 16
MAX_COMMIT_WORKERS = 256
# Rank manifests read ahead of the checks, per worker.
_READ_AHEAD = 8
_UNREADABLE = "a rank manifest is missing or unreadable"


class CommitOptions(Protocol):
    """What the committer reads of the writer's options (``WriterOptions`` is one)."""

    @property
    def checksum(self) -> ChecksumAlgorithm: ...
    @property
    def compression(self) -> enum.Enum: ...
    @property
    def overwrite(self) -> bool: ...
    @property
    def signing_key(self) -> bytes | None: ...


class Committer:
    """Publishes one save; stateless between calls."""

    def __init__(
        self, backend: Backend, options: CommitOptions, *, workers: int = DEFAULT_COMMIT_WORKERS
    ) -> None:
        require_int("workers", workers, 1, maximum=MAX_COMMIT_WORKERS)
        self.backend, self.options, self.workers = backend, options, workers

    def publish(
        self,
        publication: Publication,
        *,
        world_size: int,
        step: int | None,
        metadata: Metadata,
        results: list[list[WriteResult]],
        metrics: Mapping[str, float | str] | None = None,
    ) -> Manifest:
        """Verify, then publish the save of ``publication`` (claimed). Returns its manifest.

        Raises:
            CommitError: results or rank manifests do not add up; nothing is published.
            StaleWriterError: a newer job attempt saves under this root, or another save took
                the name over; nothing is published and this save's files are removed.
            CheckpointExistsError: ``name`` was committed by someone else meanwhile.
            StorageError: an I/O step failed; nothing is published.
        """
        name, save_id, attempt = publication.name, publication.save_id, publication.claimant.attempt
        try:
            publication.check()  # before reading anything: the name may have been taken over
            per_rank, reports = records_by_rank(results)
            if len(per_rank) != world_size:
                raise CommitError(
                    f"expected results from {world_size} ranks, got {len(per_rank)}",
                    {r: "no results" for r in range(world_size) if r not in per_rank},
                )
            check_every_item_written(metadata, per_rank)
            files = self._check_ranks(publication, per_rank, reports)
            metadata_bytes, plain = dcp_metadata(metadata, name, save_id, results, per_rank)
            algorithm = self.options.checksum
            checksum = digest_bytes(metadata_bytes, algorithm)
            files.append(FileRecord(layout.DCP_METADATA, len(metadata_bytes), checksum))
            manifest = Manifest(
                name=name,
                save_id=save_id,
                world_size=world_size,
                created_at=time.time(),
                checksum_algorithm=algorithm.value,
                compression=self.options.compression.value,
                files=tuple(files),
                items=tuple(rec for r in sorted(per_rank) for rec in per_rank[r]),
                dcp_safe_version=__version__,
                torch_version=torch.__version__,
                step=step,
                attempt=None if attempt is None else attempt.number,
                dcp_metadata=plain,
                metrics=metrics,
            )
            try:
                publication.publish_manifest(
                    manifest,
                    {layout.DCP_METADATA: metadata_bytes},
                    signing_key=self.options.signing_key,
                    replace=self.options.overwrite,
                )
            except FileExistsError as exc:
                raise self._taken(name) from exc
        except BaseException as exc:
            publication.discard(exc)
            raise
        return manifest

    def _check_ranks(
        self,
        publication: Publication,
        per_rank: Mapping[int, list[ItemRecord]],
        reports: Mapping[int, RankReport],
    ) -> list[FileRecord]:
        """Check every rank's manifest and size every shard file, ``workers`` calls at a time.

        A rank that sent no report has its manifest read back and checked against its results,
        then goes on as if it had reported it. Returns every rank's shard files, in rank order,
        then the records of their rank manifests.
        """
        work_dir, ranks = publication.work_dir, sorted(per_rank)
        unreported = [rank for rank in ranks if rank not in reports]
        with ThreadPoolExecutor(self.workers, thread_name_prefix="dcp_safe-commit") as pool:
            try:
                listing = pool.submit(self.backend.sizes, work_dir)
                ranks_dir = f"{work_dir}/{layout.RANKS_DIR}"
                manifests = pool.submit(self.backend.sizes, ranks_dir) if reports else None
                read_back: dict[int, RankReport] = {}
                # Reads run at most ``window`` ahead of the checks (thousands of manifests are not
                # held at once), so a worker never waits for them; checks hold the interpreter
                # lock (parsing), so they run here, in rank order: on the workers they contended.
                window = _READ_AHEAD * self.workers
                reads: dict[int, Future[bytes]] = {}
                for n, rank in enumerate(unreported):
                    for later in unreported[len(reads) + n : n + window + 1]:
                        reads[later] = pool.submit(self._read_rank, work_dir, later)
                    raw = reads.pop(rank).result()
                    read_back[rank] = self._report_of(publication, rank, raw, per_rank[rank])
                listed = {"": listing.result()}
                if manifests:
                    listed[layout.RANKS_DIR] = manifests.result()
            except BaseException:
                # The calls not yet started are cancelled and the running ones waited for, so
                # that no call touches storage after we return.
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        sizes = ListedSizes(self.backend, work_dir, listed=listed)
        shards: list[FileRecord] = []
        every = {**read_back, **reports}
        for rank in ranks:
            report = every[rank]
            if rank in reports:
                self._check_report(publication, rank, report)
                stored = _listed_size(sizes, rank, report.manifest, _UNREADABLE)
                if stored != report.manifest.size:
                    where = f"{sizes.path(report.manifest.path)}: on storage {stored} bytes"
                    raise CommitError(
                        "a rank manifest on storage is not the one its rank wrote",
                        {rank: f"{where}, written {report.manifest.size}"},
                    )
            covered: Counter[str] = Counter()
            for item in per_rank[rank]:
                covered[item.file] += item.length
            if unlisted := covered.keys() - {file.path for file in report.files}:
                raise CommitError(
                    "a rank's items lie in a file its manifest does not list",
                    {rank: ", ".join(sorted(unlisted)[:5])},
                )
            for file in report.files:
                actual = _listed_size(sizes, rank, file, "a shard file is missing")
                if not actual == file.size == covered[file.path]:
                    detail = (
                        f"on storage {actual}, manifest {file.size}, items {covered[file.path]}"
                    )
                    raise CommitError(
                        "a shard file is not the size its items add up to",
                        {rank: f"{file.path}: {detail}"},
                    )
            shards += report.files
        return shards + [every[rank].manifest for rank in ranks]

    def _read_rank(self, work_dir: str, rank: int) -> bytes:
        try:
            return self.backend.read_small(
                f"{work_dir}/{layout.rank_manifest_name(rank)}", MANIFEST_MAX_BYTES
            )
        except (FileNotFoundError, DcpSafeError) as exc:
            raise CommitError(_UNREADABLE, {rank: str(exc)}) from exc

    def _report_of(
        self, publication: Publication, rank: int, raw: bytes, items: list[ItemRecord]
    ) -> RankReport:
        """A rank manifest read back, checked against the rank's results; its items are
        dropped (they equal the results, and thousands of copies would pile up)."""
        rel = layout.rank_manifest_name(rank)
        try:
            path = self.backend.full_path(f"{publication.work_dir}/{rel}")
            manifest = RankManifest.from_json(raw, path)
        except DcpSafeError as exc:
            raise CommitError(_UNREADABLE, {rank: str(exc)}) from exc
        report = report_for(manifest, raw, self.options.checksum)
        self._check_report(publication, rank, report)
        if not same_records(manifest.items, items):
            raise CommitError("rank manifest disagrees with the rank's write results", {rank: rel})
        return report

    def _check_report(self, publication: Publication, rank: int, report: RankReport) -> None:
        """A rank's report is of this save and this rank, checksummed as the coordinator does."""
        got = (report.name, report.save_id, report.rank)
        if got != (publication.name, publication.save_id, rank):
            raise CommitError(
                "a rank manifest belongs to another save",
                {rank: f"{report.name}/{report.save_id} rank {report.rank}"},
            )
        expected = self.options.checksum.value
        used = (report.manifest.checksum or "").partition(":")[0]
        if used != expected:
            # The global manifest names one algorithm for every file it lists.
            raise CommitError(
                f"a rank checksummed its manifest with another algorithm than {expected!r}: "
                "every rank must be configured alike",
                {rank: used or "no checksum"},
            )

    def _taken(self, name: str) -> CheckpointExistsError:
        if self.backend.exists(f"{name}/{layout.COMMITTED_MARKER}"):
            return CheckpointExistsError(self.backend.full_path(name))
        return CheckpointExistsError(
            self.backend.full_path(name),
            f"it holds no checkpoint (no {layout.COMMITTED_MARKER} marker) but something is in"
            " the way: an empty or leftover folder, or a file. Remove it, or save under another"
            " name; `dcp-safe gc` removes an empty folder once it has been idle for its grace"
            " period",
        )


def _listed_size(sizes: ListedSizes, rank: int, file: FileRecord, missing: str) -> int:
    try:
        return sizes.size(file.path)
    except FileNotFoundError as exc:
        raise CommitError(missing, {rank: sizes.path(file.path)}) from exc
