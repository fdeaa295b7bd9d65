"""stage() takes the last plan on an unchanged structure; the staging thread confirms its key.

A changed layout under the same containers (a shape, dtype, device or aliasing change) must get
a fresh plan with the right bytes, be admitted anew against the budget (never over-committing),
and never weaken the mutation guard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from dcp_safe.errors import AdmissionTimeoutError, BudgetExceededError, SnapshotMutatedError
from dcp_safe.staging import BudgetedStager, MemoryBudget, StagerOptions
from dcp_safe.staging._tree import scan
from dcp_safe.staging.plan import PlanCache
from dcp_safe.staging.pool import BufferPool
from dcp_safe.testing.staging import hold_staging

KiB = 1 << 10
# Pageable buffers even where CUDA is available: pinning is not what these tests check.
CPU = StagerOptions(pin_memory="off")


def _budget(nbytes: int) -> MemoryBudget:
    return MemoryBudget(usable_bytes=nbytes, reserve_bytes=0, available_bytes=nbytes)


def _state(numel: int = 256) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((numel,), float(i)) for i in range(4)}, "step": 1}


def _stage(stager: BudgetedStager, state: dict[str, Any]) -> dict[str, Any]:
    stager.run_on_staging_thread(lambda: None).result()  # let a dropped dict's release run
    staged: dict[str, Any] = stager.stage(state).result()
    return staged


def _equal(staged: dict[str, Any], state: dict[str, Any]) -> bool:
    pairs = [(staged["model"][k], v) for k, v in state["model"].items()]
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


def test_speculate_offers_the_last_plan_only_for_the_same_structure() -> None:
    cache = PlanCache(BufferPool(pin_memory="off"))
    state = _state()
    assert cache.speculate(scan(state), lambda plan: True) is None  # no plan yet
    plan = cache.get(scan(state))
    state["model"]["w0"] = torch.zeros(999)  # same structure, other shape: still offered
    assert cache.speculate(scan(state), lambda plan: True) is plan
    assert plan.key != scan(state).key
    hits = cache.hits
    assert cache.speculate(scan(state), lambda plan: False) is None  # not admitted now
    assert cache.hits == hits  # a refused guess is not counted as a reuse
    state["model"]["w9"] = torch.zeros(1)  # a key added: the structure changed
    assert cache.speculate(scan(state), lambda plan: True) is None


def test_a_shape_change_under_the_same_keys_gets_a_fresh_plan_and_right_bytes() -> None:
    state = _state()
    with BudgetedStager(_budget(1 << 20), options=CPU) as stager:
        for _ in range(2):
            del _stage(stager, state)["model"]
        state["model"]["w1"] = torch.arange(4096, dtype=torch.float32)  # larger than its buffer
        state["model"]["w2"] = torch.arange(256, dtype=torch.int32)  # same bytes, other dtype
        staged = _stage(stager, state)
        assert _equal(staged, state)
        stats = stager.stats()
        assert (stats.plans_built, stats.in_flight) == (2, 1)
        del staged
        again = _stage(stager, state)  # the new plan is the one speculated next
        assert _equal(again, state) and stager.stats().plans_built == 2
        del again


def test_an_aliasing_change_under_the_same_keys_is_staged_as_one_tensor() -> None:
    state = _state()
    with BudgetedStager(_budget(1 << 20), options=CPU) as stager:
        del _stage(stager, state)["model"]
        state["model"]["w3"] = state["model"]["w0"]
        staged = _stage(stager, state)
        assert staged["model"]["w3"] is staged["model"]["w0"] and _equal(staged, state)
        del staged


def test_readmission_of_a_changed_layout_never_exceeds_the_budget() -> None:
    # Room for 8 KiB: the old layout (4 KiB) fits, the new one (7 KiB) fits only alone, so the
    # guessed lease must be given back before the new one is taken.
    state = _state(256)
    envelope = 8 * KiB
    with BudgetedStager(_budget(envelope), options=CPU) as stager:
        for _ in range(2):
            del _stage(stager, state)["model"]
        state["model"]["w0"] = torch.ones(1024)  # 4 KiB instead of 1 KiB
        staged = _stage(stager, state)
        assert _equal(staged, state)
        stats = stager.stats()
        assert stats.peak_pool_bytes <= envelope and stats.pool_bytes <= envelope
        del staged


def test_a_changed_layout_larger_than_the_envelope_fails_the_staging_future() -> None:
    state = _state(256)
    with BudgetedStager(_budget(8 * KiB), options=CPU) as stager:
        del _stage(stager, state)["model"]
        state["model"]["w0"] = torch.ones(4096)  # 16 KiB: can never fit
        stager.run_on_staging_thread(lambda: None).result()
        future = stager.stage(state)  # admitted on the last plan's bytes
        with pytest.raises(BudgetExceededError):
            future.result()
        stats = stager.stats()
        assert stats.in_flight == 0 and stats.peak_pool_bytes <= 8 * KiB
        state["model"]["w0"] = torch.ones(256)  # back to a layout that fits: saves work again
        assert _equal(_stage(stager, state), state)


def test_a_changed_layout_that_does_not_fit_beside_another_save_is_refused() -> None:
    state = _state(256)  # 4 KiB
    with BudgetedStager(
        _budget(10 * KiB),
        options=StagerOptions(pin_memory="off", max_in_flight=2, when_busy="raise"),
    ) as stager:
        held = _stage(stager, state)  # in flight, holding 4 KiB
        try:
            state["model"]["w0"] = torch.ones(1024)  # 7 KiB now: the guess (4) fits, it not
            future = stager.stage(state)
            with pytest.raises(AdmissionTimeoutError, match="shapes or dtypes changed"):
                future.result()
            stats = stager.stats()
            assert stats.peak_pool_bytes <= 10 * KiB and stats.in_flight == 1
        finally:
            del held


def test_an_update_during_a_changed_layouts_copy_is_still_refused(tmp_path: Path) -> None:
    state = _state()
    with BudgetedStager(_budget(1 << 20), options=CPU) as stager:
        del _stage(stager, state)["model"]
        state["model"]["w1"] = torch.ones(512)  # the guess is wrong: re-planned on the thread
        with hold_staging(stager):
            response = stager.async_save(
                state, storage_writer=FileSystemWriter(tmp_path / "a"), no_dist=True
            )
            state["model"]["w1"].add_(1.0)  # after the request, before the copy
        with pytest.raises(SnapshotMutatedError) as raised:
            response.upload_completion.result()
        assert raised.value.fqns == ("model.w1",)
        assert stager.stats().torn == 1


def test_an_update_of_a_tensor_the_guessed_plan_did_not_pick_is_still_refused() -> None:
    # The last plan staged w3 as an alias of w0; now w3 is its own tensor, which the guessed
    # plan does not copy. Its counter is read at the request all the same.
    state = _state()
    state["model"]["w3"] = state["model"]["w0"]
    with BudgetedStager(_budget(1 << 20), options=CPU) as stager:
        del _stage(stager, state)["model"]
        state["model"]["w3"] = torch.full((256,), 3.0)
        stager.run_on_staging_thread(lambda: None).result()
        with hold_staging(stager):
            future = stager.stage(state)
            state["model"]["w3"].add_(1.0)
        with pytest.raises(SnapshotMutatedError) as raised:
            future.result()
        assert raised.value.fqns == ("model.w3",)
