"""UploadEngine: a commit wait runs beside the next upload, never in front of it.

No storage: the jobs are plain functions and their timing is set by events, never by sleeps.
"""

from __future__ import annotations

import threading

import pytest

from dcp_safe.errors import CommitError, ReplicationTimeoutError
from dcp_safe.manifest.schema import FileRecord, Manifest
from dcp_safe.replication.engine import Job, UploadEngine

# Generous: only a guard against a hung test, never a measure of speed.
_TIMEOUT_S = 60.0

_MANIFEST = Manifest(
    name="step_1",
    save_id="abc",
    world_size=2,
    created_at=1.5,
    checksum_algorithm="xxh3_128",
    compression="none",
    files=(FileRecord(path="__0_0.distcp", size=10),),
    items=(),
    dcp_safe_version="0.1.0",
    torch_version="2.13.0",
    step=1,
)


class _LateRank(UploadEngine):
    """Uploads at once; step_1's commit then waits for a late rank (``arrived``)."""

    def __init__(self, *, fails: bool = False) -> None:
        super().__init__("test uploads", thread_name="dcp_safe-test-engine")
        self.taken, self.arrived = threading.Event(), threading.Event()
        self.fails = fails
        self.uploaded: list[str] = []

    def _run_job(self, name: str) -> Manifest | Job:
        self.uploaded.append(name)
        self.taken.set()
        return self._commit if name == "step_1" else _MANIFEST

    def _commit(self) -> Manifest:
        assert self.arrived.wait(_TIMEOUT_S)
        if self.fails:
            raise CommitError("rank 1 never arrived", {1: "late"})
        return _MANIFEST


def test_a_commit_waiting_for_a_late_rank_holds_back_no_other_upload() -> None:
    engine = _LateRank()
    first = engine.submit("step_1")
    assert engine.taken.wait(_TIMEOUT_S)  # the lane took step_1: step_2 is pending, not replacing
    second = engine.submit("step_2")

    # step_2 uploads and finishes while step_1's commit still waits for its late rank.
    assert second.result(timeout=_TIMEOUT_S) is _MANIFEST
    assert not first.done() and engine.uploaded == ["step_1", "step_2"]
    assert engine.skipped == []
    assert engine.submit("step_1") is first  # a name still waiting keeps its future
    with pytest.raises(ReplicationTimeoutError, match="step_1"):
        engine.close(timeout_s=0.01)  # close drains the commit waits too (bounded)

    engine.arrived.set()
    engine.close(timeout_s=_TIMEOUT_S)
    assert first.result() is _MANIFEST


def test_a_failed_commit_wait_reaches_its_future_and_close() -> None:
    engine = _LateRank(fails=True)
    first = engine.submit("step_1")
    engine.arrived.set()
    with pytest.raises(CommitError, match="never arrived"):
        engine.close(timeout_s=_TIMEOUT_S)  # nobody retrieved it: close raises it
    assert isinstance(first.exception(), CommitError)


def test_started_jobs_run_side_by_side_at_once() -> None:
    engine = UploadEngine("test commits")
    second_started = threading.Event()

    def first_job() -> Manifest:
        assert second_started.wait(_TIMEOUT_S)  # queued behind each other, this would hang
        return _MANIFEST

    def second_job() -> Manifest:
        second_started.set()
        return _MANIFEST

    first = engine.start("step_1", first_job)
    second = engine.start("step_2", second_job)
    assert first.result(timeout=_TIMEOUT_S) is second.result(timeout=_TIMEOUT_S) is _MANIFEST
    assert engine.futures() == [first, second]
    engine.close(timeout_s=_TIMEOUT_S)
