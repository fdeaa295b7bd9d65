"""Staging under two gloo ranks: one rank's torn snapshot, or a re-plan its budget refuses, fails
the save everywhere.

The failing rank must not simply drop out of the save: its peer would wait in DCP's collectives
until the deadline. Here the deadline is far longer than the run's own timeout, so the test
passes only if every rank learns of the failure from the save itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_safe
from dcp_safe import (
    BudgetedStager,
    SafeStorageReader,
    SafeStorageWriter,
    StagerOptions,
    list_checkpoints,
)
from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.staging import MemoryBudget
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.testing.staging import hold_staging

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

DEADLINE_S = 600.0  # longer than run_ranks' timeout: a rank left waiting fails the test
MiB = 1 << 20


def _state(rank: int) -> dict[str, Any]:
    return {"shared.bias": torch.full((256,), 7.0), f"rank{rank}.w": torch.full((4096,), 1.0)}


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


def _rank_1_updates_during_its_copy(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _state(rank)
    seen: dict[str, Any] = {}
    with BudgetedStager() as stager:
        if rank == 1:
            with hold_staging(stager):
                response = _save(state, root, "torn", stager)
                state["rank1.w"].add_(1)  # before rank 1's copy has started
        else:
            response = _save(state, root, "torn", stager)
        try:
            response.upload_completion.result(timeout=120)
            seen["error"] = None
        except SnapshotMutatedError as exc:
            seen.update(error="SnapshotMutatedError", rank=exc.rank, fqns=list(exc.fqns))
        except BaseException as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"
        seen["listed"] = [info.name for info in list_checkpoints(root)]
        seen["torn_here"] = stager.stats().torn

        # Nothing is left stuck: the next save of the same ranks commits.
        _save(state, root, "next", stager).upload_completion.result(timeout=120)
        seen["listed_after"] = [info.name for info in list_checkpoints(root)]
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp_safe.load(target, checkpoint_id="next", storage_reader=SafeStorageReader(root))
        seen["next_exact"] = all(torch.equal(target[k], state[k]) for k in state)
    return seen


def test_one_ranks_torn_snapshot_fails_the_save_on_every_rank_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    per_rank = run_ranks(_rank_1_updates_during_its_copy, 2, args=(str(tmp_path),))

    for rank, seen in enumerate(per_rank):
        assert seen["error"] == "SnapshotMutatedError", (rank, seen)
        assert seen["rank"] == 1, (rank, seen)
        assert seen["fqns"] == ["rank1.w"], (rank, seen)
        assert seen["listed"] == [], (rank, seen)
        assert seen["listed_after"] == ["next"], (rank, seen)
        assert seen["next_exact"], (rank, seen)
    assert [seen["torn_here"] for seen in per_rank] == [0, 1]
    assert not (tmp_path / "torn").exists()


def _rank_1_outgrows_its_budget(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = {f"rank{rank}.w": torch.ones(4096)}  # 16 KiB
    budget = MemoryBudget(usable_bytes=1 * MiB, reserve_bytes=0, available_bytes=1 * MiB)
    seen: dict[str, Any] = {}
    with BudgetedStager(budget, options=StagerOptions(pin_memory="off")) as stager:
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


def test_one_ranks_refused_replan_fails_the_save_on_every_rank_at_once(tmp_path: Path) -> None:
    per_rank = run_ranks(_rank_1_outgrows_its_budget, 2, args=(str(tmp_path),))

    for rank, seen in enumerate(per_rank):
        assert seen["error"] == "BudgetExceededError", (rank, seen)
        assert seen["listed"] == ["first"], (rank, seen)
        assert seen["third_exact"], (rank, seen)
    assert not (tmp_path / "second").exists()
