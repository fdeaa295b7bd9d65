"""A staging failure on one rank fails the save on every rank, inside DCP's collective.

The failing rank must not simply drop out of the save: its peer would wait in DCP's collectives
until the deadline. Here the deadline is far longer than the run's own timeout, so the
multi-rank test passes only if every rank learns of the failure from the save itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_safe
from dcp_safe import (
    BudgetedStager,
    BudgetExceededError,
    SafeStorageReader,
    SafeStorageWriter,
    SnapshotMutatedError,
    list_checkpoints,
)
from dcp_safe.staging import MemoryBudget
from dcp_safe.staging.poison import POISON_KEY, poisoned
from dcp_safe.testing.multiproc import run_ranks

DEADLINE_S = 600.0  # longer than run_ranks' timeout: a rank left waiting fails the test
MiB = 1 << 20


@pytest.mark.parametrize(
    "error", [SnapshotMutatedError(["model.w"], rank=3), BudgetExceededError("too big")]
)
def test_a_poisoned_state_fails_in_dcps_planner_without_writing(
    tmp_path: Path, error: Exception
) -> None:
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException
        dcp.save(poisoned(error), storage_writer=SafeStorageWriter(tmp_path), checkpoint_id="p")
    failures = caught.value.failures  # type: ignore[attr-defined]
    [(cause, _)] = failures.values()
    assert cause is error or type(cause) is type(error)
    assert list_checkpoints(tmp_path) == []
    assert POISON_KEY.startswith("__dcp_safe")


def _save(state: dict[str, Any], root: str, name: str, stager: BudgetedStager) -> Any:
    response = dcp_safe.async_save(
        state,
        checkpoint_id=name,
        storage_writer=SafeStorageWriter(root),
        async_stager=stager,
        deadline_s=DEADLINE_S,
    )
    stager.track(response)
    return response


def _rank_1_outgrows_its_budget(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = {f"rank{rank}.w": torch.ones(4096)}  # 16 KiB
    budget = MemoryBudget(usable_bytes=1 * MiB, reserve_bytes=0, available_bytes=1 * MiB)
    seen: dict[str, Any] = {}
    with BudgetedStager(budget, pin_memory="off") as stager:
        _save(state, root, "first", stager).upload_completion.result(timeout=120)
        if rank == 1:
            # Same keys, so stage() reuses the last plan on the caller's thread; the staging
            # thread then finds the shape changed, re-plans, and the budget refuses 4 MiB.
            state["rank1.w"] = torch.ones(MiB)
        try:
            _save(state, root, "second", stager).upload_completion.result(timeout=120)
            seen["error"] = None
        except BaseException as exc:
            seen["error"] = type(exc).__name__
        seen["listed"] = sorted(info.name for info in list_checkpoints(root))

        state[f"rank{rank}.w"] = torch.full((4096,), 2.0)  # back within the budget
        _save(state, root, "third", stager).upload_completion.result(timeout=120)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp_safe.load(target, checkpoint_id="third", storage_reader=SafeStorageReader(root))
        seen["third_exact"] = all(torch.equal(target[k], state[k]) for k in state)
    return seen


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_one_ranks_refused_replan_fails_the_save_on_every_rank_at_once(tmp_path: Path) -> None:
    per_rank = run_ranks(_rank_1_outgrows_its_budget, 2, args=(str(tmp_path),))

    for rank, seen in enumerate(per_rank):
        assert seen["error"] == "BudgetExceededError", (rank, seen)
        assert seen["listed"] == ["first"], (rank, seen)
        assert seen["third_exact"], (rank, seen)
    assert not (tmp_path / "second").exists()
