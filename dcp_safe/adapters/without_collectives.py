"""One save without collectives, as ``SafeStorageWriter`` runs it: agree, then gather.

The two steps that differ from a collective save (docs/multirank.md, "Saves without
collectives"): in ``prepare_global_plan`` the ranks agree on the save id through storage
(:mod:`dcp_safe.adapters.assignment_board`), and in ``finish`` rank 0 gathers every rank's report
(:mod:`dcp_safe.adapters.rank_reports`) before the unchanged committer publishes. With a signing
key, what a rank leaves on storage for rank 0 is authenticated under it (``rank_reports``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from dcp_safe.adapters import rank_reports
from dcp_safe.adapters.assignment_board import Assignment, AssignmentBoard, leave_to_rank0
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.publication import Publication
from dcp_safe.commit.report import ReportedItem
from dcp_safe.errors import ConfigError, DivergentStateError
from dcp_safe.manifest.checksum import ChecksumAlgorithm

__all__ = ["StorageAgreement", "world_size"]


def world_size() -> int:
    """The ranks of a save without collectives: those of the default process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class StorageAgreement:
    """One save of ``name`` without collectives, on ``backend``."""

    backend: Backend
    name: str
    board: AssignmentBoard
    checksum: ChecksumAlgorithm
    #: The publication of a save id (the writer's, made by the root's strategy).
    publication: Callable[[str], Publication]
    #: The writer's signing key: every rank's report is authenticated under it.
    signing_key: bytes | None = None

    def agree(
        self,
        plan: SavePlan,
        *,
        rank: int,
        coordinator: bool,
        plain: dict[str, int | None],
        claim: Callable[[list[SavePlan]], list[SavePlan]],
    ) -> SavePlan:
        """``plan`` with this save's assignment: rank 0 claims (``claim``) and posts the save
        id; the others take it and leave the plain entries rank 0 holds to it.

        Raises:
            DivergentStateError: this rank's copy of a plain entry differs from rank 0's.
            CommitError: rank 0 posted nothing in time, or failed (naming rank 0).
        """
        world = world_size()
        if coordinator:
            try:
                plan = claim([plan])[0]
                assignment = dataclasses.replace(_assignment_of(plan), world_size=world)
                self.board.post(assignment.save_id, world, plain)
            except BaseException as exc:
                self.board.post_failure(exc)
                raise
            return dataclasses.replace(plan, storage_data=assignment)
        save_id, taken = self.board.take(world)
        skip, divergent = leave_to_rank0(plain, taken, rank)
        work_dir = self.publication(save_id).work_dir
        assignment = Assignment(rank, world, save_id, work_dir, skip)
        if divergent:
            error = DivergentStateError(divergent)
            rank_reports.report_failure(self.backend, assignment, error)
            raise error
        return dataclasses.replace(plan, storage_data=assignment)

    def report(
        self, assignment: Assignment, metadata: Metadata, results: list[list[WriteResult]]
    ) -> None:
        """A rank other than 0: its part is on storage (:func:`rank_reports.write_report`); if
        the report cannot be written, a failure marker says so (rank 0 fails at once)."""
        first = results[0][0].storage_data if results and results[0] else None
        # The checksum of the rank manifest as this rank wrote it (not as storage now holds it).
        checksum = first.report.manifest.checksum if isinstance(first, ReportedItem) else None
        try:
            rank_reports.write_report(
                self.backend,
                assignment,
                metadata,
                manifest_checksum=checksum,
                key=self.signing_key,
            )
        except BaseException as exc:
            rank_reports.report_failure(self.backend, assignment, exc)
            raise

    def failed(self, assignment: Assignment, exc: BaseException, *, coordinator: bool) -> None:
        """This rank's write failed: tell rank 0 (best effort); rank 0 withdraws the save id."""
        rank_reports.report_failure(self.backend, assignment, exc)
        if coordinator:
            self.board.clear()

    def gather(
        self,
        assignment: Assignment,
        metadata: Metadata,
        results: list[list[WriteResult]],
        *,
        on_failure: Callable[[BaseException], None],
    ) -> tuple[Metadata, list[list[WriteResult]]]:
        """Rank 0: every rank's report, merged, once all are on storage. On a failure nothing
        is published, the save's files are removed and ``on_failure`` is told.

        Raises:
            DivergentStateError: a rank's copy of a plain entry differs from rank 0's.
            CommitError: a rank failed or did not report within the deadline (naming it).
        """
        try:
            key, deadline_s = self.signing_key, self.board.deadline_s
            reports = rank_reports.await_reports(self.backend, assignment, deadline_s, key=key)
            own = (metadata, results[0])
            return rank_reports.gathered(
                self.backend,
                self.name,
                assignment,
                self.checksum,
                own,
                reports,
                signed=key is not None,
            )
        except BaseException as exc:
            self.publication(assignment.save_id).discard(exc)
            on_failure(exc)
            raise
        finally:
            self.board.clear()


def _assignment_of(plan: SavePlan) -> Assignment:
    if not isinstance(plan.storage_data, Assignment):
        raise ConfigError("the writer's own claim did not assign the save")
    return plan.storage_data
