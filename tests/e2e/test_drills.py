"""Acceptance drills: the CheckpointManager on storage that is slow, failing, or held slow.

Each drill runs the real stack (CheckpointManager -> BudgetedStager -> DCP async_save ->
SafeStorageWriter) on a ``faulty://`` local root (:mod:`dcp_safe.testing.faulty_fs`):

* slow destination: every write is delayed; every save's futures still complete, and each
  checkpoint verifies and loads as saved;
* one forced write failure: the error reaches that save's future (and ``close``), the
  generation's staging buffers are released, and the next eligible save commits;
* destination held slow for longer than one checkpoint interval: requests that arrive while a
  save is in flight are skipped (or coalesced into one pending copy), never queued, so staged
  memory stays within the budget and within one or two copies of the state, however many steps
  pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _crash import (
    blank_like,
    is_bit_exact,
    make_values,
    record_figures,
)

import dcp_safe
from dcp_safe import (
    Bounds,
    BudgetedStager,
    CheckpointManager,
    FallbackOptions,
    MemoryBudget,
    Runtime,
    SafeStorageReader,
    SafeStorageWriter,
    SavePolicy,
    StorageError,
    WriterOptions,
)
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan

pytestmark = pytest.mark.timeout(300)

# Room for about four copies of the drills' state (17.6 KB of tensors): tight enough that a
# queue of staged copies would show against it.
BUDGET_BYTES = 72 << 10
# A bounded wait for futures: only ever reached by a hang.
DEADLINE_S = 120.0


def _state(step: int) -> dict[str, Any]:
    """A state of ~80 KB of tensors (and a Python object)."""
    return make_values(step, scale=8)


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


def _manager(
    root: Path, faults: FaultInjector, when_busy: str, stager: BudgetedStager
) -> CheckpointManager:
    url = f"faulty://{root}"
    options = {"target_protocol": "file", "faults": faults}
    writer = SafeStorageWriter(url, storage_options=options, options=WriterOptions(thread_count=1))
    return CheckpointManager(
        url,
        when_busy=when_busy,
        keep_last=10,
        policy=SavePolicy(name_format="step_{step}", sync_fallback=FallbackOptions(enabled=False)),
        bounds=Bounds(exit_timeout_s=DEADLINE_S),
        runtime=Runtime(writer=writer, stager=stager),
    )


def _stager() -> BudgetedStager:
    return BudgetedStager(MemoryBudget(usable_bytes=BUDGET_BYTES, reserve_bytes=0))


def _loads_as_saved(root: Path, name: str, state: dict[str, Any], faults: FaultInjector) -> bool:
    faults.pause()
    try:
        url = f"faulty://{root}"
        options = {"target_protocol": "file", "faults": faults}
        dcp_safe.verify_checkpoint(url, name, storage_options=options)
        target = blank_like(state)
        reader = SafeStorageReader(url, storage_options=options)
        dcp_safe.load(target, checkpoint_id=name, storage_reader=reader, no_dist=True)
        return is_bit_exact(target, state)
    finally:
        faults.resume()


def test_slow_destination_every_future_completes_and_every_checkpoint_verifies(
    tmp_path: Path,
) -> None:
    faults = FaultInjector(FaultPlan(delay_s=0.002, ops=("write", "close", "pipe", "move")))
    stager = _stager()
    manager = _manager(tmp_path, faults, "wait", stager)
    handles = []
    with stager:
        for step in (1, 2, 3):
            handle = manager.save(step, _state(step))
            assert handle is not None
            handles.append(handle)
        manager.close(timeout_s=DEADLINE_S)
    assert [h.committed.result(timeout=DEADLINE_S) for h in handles] == [
        "step_1",
        "step_2",
        "step_3",
    ]
    assert faults.injected["delay"] > 0
    for step in (1, 2, 3):
        assert _loads_as_saved(tmp_path, f"step_{step}", _state(step), faults)
    assert manager.stats().committed == 3


def test_one_forced_write_failure_reaches_the_future_frees_buffers_and_next_save_commits(
    tmp_path: Path,
) -> None:
    faults = FaultInjector(FaultPlan(fail_at=5, ops=("write",), error="enospc"))
    stager = _stager()
    manager = _manager(tmp_path, faults, "wait", stager)
    with stager:
        failed = manager.save(1, _state(1))
        assert failed is not None
        error = failed.committed.exception(timeout=DEADLINE_S)
        assert isinstance(error, StorageError), error
        assert "injected fault" in str(error)
        after_failure = stager.stats()
        # The failed generation gave its buffers back: nothing in flight, nothing leased.
        assert after_failure.in_flight == 0 and after_failure.in_use_bytes == 0
        following = manager.save(2, _state(2))
        assert following is not None
        assert following.committed.result(timeout=DEADLINE_S) == "step_2"
        with pytest.raises(StorageError):
            manager.close(timeout_s=DEADLINE_S)  # the kept error of step 1 is raised once
    assert _loads_as_saved(tmp_path, "step_2", _state(2), faults)
    listed = [c.name for c in dcp_safe.list_checkpoints(tmp_path)]
    assert listed == ["step_2"]
    stats = manager.stats()
    assert (stats.failed, stats.committed) == (1, 1)


@pytest.mark.parametrize("when_busy", ["skip", "coalesce"])
def test_destination_held_slow_past_the_interval_bounds_memory_instead_of_queueing(
    tmp_path: Path, when_busy: str
) -> None:
    # Each file a save opens is held 0.1 s: a save takes seconds, the twelve steps far less.
    faults = FaultInjector(FaultPlan(delay_s=0.1, ops=("open",)))
    stager = _stager()
    manager = _manager(tmp_path, faults, when_busy, stager)
    steps = 12
    state = _state(0)
    copies_seen = 0
    with stager:
        for step in range(1, steps + 1):
            state["w"].add_(1.0)  # training mutates the live state
            manager.maybe_save(step, state)
            stats = stager.stats()
            copies_seen = max(copies_seen, stats.in_flight)
            assert stats.pool_bytes <= BUDGET_BYTES
        manager.close(timeout_s=DEADLINE_S)
    stats, counts = stager.stats(), manager.stats()
    state_bytes = _state_bytes(state)
    record_figures(
        "drill",
        when_busy=when_busy,
        requests=counts.requested,
        started=counts.started,
        skipped=counts.skipped,
        coalesced=counts.coalesced,
        peak_pool_bytes=stats.peak_pool_bytes,
        state_bytes=state_bytes,
        budget_bytes=BUDGET_BYTES,
    )
    print(
        f"held slow ({when_busy}): {counts.requested} requests, {counts.started} saves started, "
        f"{counts.skipped} skipped, {counts.coalesced} coalesced; peak staged "
        f"{stats.peak_pool_bytes} B for a {state_bytes} B state, budget {BUDGET_BYTES} B"
    )
    assert counts.requested == steps
    # Not one queued save per step: the work in flight stayed bounded.
    assert stats.peak_in_flight <= 1 and copies_seen <= 1
    assert counts.started < steps
    if when_busy == "skip":
        assert counts.skipped >= 1
    else:
        assert counts.coalesced >= 1
    # Memory: within the budget, and one staging copy (reused), not one per request.
    assert stats.peak_pool_bytes <= BUDGET_BYTES
    assert stats.peak_pool_bytes <= 2 * state_bytes
    assert counts.committed == counts.started
