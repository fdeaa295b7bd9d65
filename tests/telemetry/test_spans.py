"""Phase spans of real saves: ordered and nested for sync, async, failed and replicated saves."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_state, ready_worker
from telemetry._spans import check_nesting, intervals, only, phases

from dcp_safe import Runtime, SavePolicy
from dcp_safe.adapters import api
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.manager import CheckpointManager
from dcp_safe.staging import BudgetedStager
from dcp_safe.telemetry import NULL_RECORDER, Phase, Telemetry
from dcp_safe.topology import Root

DEADLINE_S = 120  # detects hangs only


class Unpicklable:
    """Survives staging (deep copy keeps it) but fails DCP's serialization in write_data."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Unpicklable:
        return self

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError("this object refuses to be pickled")


@pytest.fixture
def tel() -> Any:
    with Telemetry(sample_memory=False) as telemetry:
        yield telemetry


def test_sync_save_nests_plan_write_commit_under_the_save_in_order(
    tmp_path: Path, tel: Telemetry
) -> None:
    from torch.profiler import ProfilerActivity, profile

    writer = tel.wrap_writer(SafeStorageWriter(tmp_path, step=7))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        api.save(make_state(0), checkpoint_id="ckpt", storage_writer=writer, no_dist=True)
    ranges = {e.name for e in prof.events()}
    assert {"dcp_safe::write", "dcp_safe::commit"} <= ranges

    spans = intervals(tel.memory.events())
    check_nesting(spans)
    assert phases(spans, "ckpt") == ["save", "plan", "write", "commit"]
    save, plan, write, commit = (only(spans, p) for p in ("save", "plan", "write", "commit"))
    assert plan.end <= write.start and write.end <= commit.start
    assert {plan.parent, write.parent, commit.parent} == {save.id}
    assert all(s.ok for s in spans)
    assert write.bytes is not None and write.bytes > 0 and commit.bytes == write.bytes


def test_async_save_nests_staging_before_write_and_releases_after_commit(
    tmp_path: Path, tel: Telemetry
) -> None:
    with CheckpointManager(tmp_path, runtime=Runtime(telemetry=tel)) as manager:
        handle = manager.save(3, make_state(1))
        assert handle is not None
        handle.committed.result(DEADLINE_S)
    spans = intervals(tel.memory.events())
    check_nesting(spans)
    name = handle.name
    assert phases(spans, name) == ["save", "staging", "plan", "write", "commit", "release"]
    save = only(spans, "save")
    staging, write, commit = only(spans, "staging"), only(spans, "write"), only(spans, "commit")
    release = only(spans, "release")
    assert staging.parent == save.id and write.parent == save.id and commit.parent == save.id
    assert staging.end <= write.start and write.end <= commit.start
    assert release.parent is None and release.start >= write.end
    assert staging.bytes is not None and release.bytes == staging.bytes
    assert tel.report().saves[0].ok


def test_failed_sync_save_fails_write_and_save_and_never_commits(
    tmp_path: Path, tel: Telemetry
) -> None:
    writer = tel.wrap_writer(SafeStorageWriter(tmp_path))
    state = {"w": torch.ones(4), "bad": Unpicklable()}
    with pytest.raises(BaseException, match="refuses to be pickled"):
        api.save(state, checkpoint_id="bad", storage_writer=writer, no_dist=True)

    spans = intervals(tel.memory.events())
    check_nesting(spans)
    assert phases(spans, "bad") == ["save", "plan", "write"]
    write, save = only(spans, "write"), only(spans, "save")
    assert not write.ok and not save.ok
    errors = [e.error for e in tel.memory.events() if e.name == "write" and e.error]
    assert errors and "refuses to be pickled" in errors[0]


# A state that does not pickle fails in the write with threads; with the worker process, as it
# is sent there, before any writer phase.
@pytest.mark.parametrize(
    ("executor", "phases_of_save"),
    [
        ("thread", ["save", "staging", "plan", "write", "release"]),
        ("process", ["save", "staging", "release"]),
    ],
)
def test_failed_async_save_fails_its_root_span_and_still_releases(
    tmp_path: Path, tel: Telemetry, executor: str, phases_of_save: list[str]
) -> None:
    manager = CheckpointManager(tmp_path, runtime=Runtime(telemetry=tel, executor=executor))
    if executor == "process":  # saves run on a thread until the worker is ready
        ready_worker(manager)
    handle = manager.save(1, {"w": torch.ones(4), "bad": Unpicklable()})
    assert handle is not None
    with pytest.raises(BaseException, match="refuses to be pickled"):
        handle.committed.result(DEADLINE_S)
    with pytest.raises(BaseException, match="refuses to be pickled"):
        manager.close(DEADLINE_S)

    spans = intervals(tel.memory.events())
    check_nesting(spans)
    assert phases(spans, handle.name) == phases_of_save
    assert only(spans, "staging").ok
    assert not only(spans, "save").ok
    if executor == "thread":
        assert not only(spans, "write").ok
    report = tel.report().to_dict()
    assert report["saves"][0]["ok"] is False


@pytest.mark.s3
def test_replicated_save_records_replication_after_the_local_commit(
    tmp_path: Path,
    tel: Telemetry,
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    writer = SafeStorageWriter(tmp_path, replicate_to=Root(s3_root, storage_options=s3_options))
    with CheckpointManager(tmp_path, runtime=Runtime(writer=writer, telemetry=tel)) as manager:
        handle = manager.save(5, make_state(2))
        assert handle is not None
        handle.replicated.result(DEADLINE_S)
    spans = intervals(tel.memory.events())
    check_nesting(spans)
    commit, replication = only(spans, "commit"), only(spans, "replication")
    assert replication.parent is None and replication.save == handle.name
    assert replication.start >= commit.end
    assert replication.ok and replication.bytes is not None and replication.bytes > 0
    assert tel.report().saves[0].replicated is True


def test_telemetry_off_is_the_null_recorder_and_starts_no_thread(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    with CheckpointManager(tmp_path) as manager:
        assert manager.stager.telemetry is NULL_RECORDER
        handle = manager.save(1, make_state(0))
        assert handle is not None
        handle.committed.result(DEADLINE_S)
        started = {t.name for t in threading.enumerate()} - before
    assert not any(name.startswith("dcp_safe-memory") for name in started)
    assert BudgetedStager().telemetry is NULL_RECORDER


def test_state_dict_span_on_the_training_thread_is_a_profiler_range(tel: Telemetry) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, tel.span(Phase.STATE_DICT, step=4):
        state = copy.deepcopy(make_state(0))
    assert state
    assert any(e.name == "dcp_safe::state_dict" for e in prof.events())
    (span,) = intervals(tel.memory.events())
    assert span.phase == "state_dict" and span.ok


def test_fallback_save_is_marked_and_runs_synchronously_under_its_root(
    tmp_path: Path, tel: Telemetry
) -> None:
    from dcp_safe.manager.fallback import FallbackOptions

    manager = CheckpointManager(
        tmp_path,
        policy=SavePolicy(sync_fallback=FallbackOptions(memory_crossings=1)),
        # The host reports no memory left: below any reserve.
        runtime=Runtime(telemetry=tel, memory_sampler=lambda: 0),
    )
    with manager:
        handle = manager.save(2, make_state(0))
        assert handle is not None
        assert handle.committed.result(DEADLINE_S) == handle.name
    spans = intervals(tel.memory.events())
    check_nesting(spans)
    assert phases(spans, handle.name) == ["save", "plan", "write", "commit"]  # no staging
    report = tel.report()
    assert report.fallbacks == 1 and report.saves[0].ok
    assert report.saves[0].stall_s == report.saves[0].completion_s  # sync: the loop waits it all


def test_null_recorder_span_yields_the_null_span_nested_and_lets_errors_through() -> None:
    with (
        NULL_RECORDER.span(Phase.SAVE, save="step_1", step=1) as outer,
        NULL_RECORDER.span(Phase.WRITE, parent=outer, bytes=8) as inner,
    ):
        assert (inner.id, inner.save, inner.step) == (None, None, None)
    with pytest.raises(ValueError, match="boom"), NULL_RECORDER.span(Phase.COMMIT):
        raise ValueError("boom")


def test_span_passes_its_keywords_to_begin(tel: Telemetry) -> None:
    root = tel.begin_save("step_000000007", step=7)
    with tel.span(Phase.WRITE, parent=root, bytes=64) as write:
        assert (write.save, write.step) == ("step_000000007", 7)  # inherited from the parent
    root.end()
    (start,) = [e for e in tel.memory.events() if e.kind == "span_start" and e.name == "write"]
    assert (start.parent, start.save, start.step, start.bytes) == (root.id, "step_000000007", 7, 64)


def test_spans_of_another_process_are_adopted_under_this_roots_save(
    tmp_path: Path, tel: Telemetry
) -> None:
    root = tel.begin_save("ckpt", step=7)
    # What the checkpoint worker records (executor="process"): its own root, then the phases.
    with Telemetry(sample_memory=False, rank=5) as worker:
        writer = worker.wrap_writer(SafeStorageWriter(tmp_path, step=7))
        api.save(make_state(0), checkpoint_id="ckpt", storage_writer=writer, no_dist=True)
        recorded = worker.memory.events()
    assert tel.adopt(recorded, root) == 3
    root.end()

    spans = intervals(tel.memory.events())
    check_nesting(spans)
    assert phases(spans, "ckpt") == ["save", "plan", "write", "commit"]
    assert only(spans, "save").id == root.id  # the worker's own root is not recorded here
    assert {s.parent for s in spans if s.phase != "save"} == {root.id}
    theirs = {s.phase: s for s in intervals(recorded)}
    for phase in ("plan", "write", "commit"):
        ours = only(spans, phase)
        assert (ours.start, ours.end, ours.bytes) == (
            theirs[phase].start,
            theirs[phase].end,
            theirs[phase].bytes,
        )
    assert {e.rank for e in tel.memory.events()} == {tel.rank}


def test_a_span_not_ended_in_the_other_process_is_not_adopted(
    tmp_path: Path, tel: Telemetry
) -> None:
    root = tel.begin_save("ckpt")
    with Telemetry(sample_memory=False) as worker:
        writer = worker.wrap_writer(SafeStorageWriter(tmp_path))
        api.save(make_state(0), checkpoint_id="ckpt", storage_writer=writer, no_dist=True)
        recorded = worker.memory.events()
    cut = [e for e in recorded if not (e.name == "commit" and e.kind == "span_end")]
    assert tel.adopt(cut, root) == 2
    root.end()
    assert phases(intervals(tel.memory.events()), "ckpt") == ["save", "plan", "write"]
