"""The mutation guard under two gloo ranks: one rank's torn snapshot fails the save everywhere.

The torn rank must not simply drop out of the save: its peer would wait in DCP's collectives
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
    SnapshotMutatedError,
    list_checkpoints,
)
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.testing.staging import hold_staging

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

DEADLINE_S = 600.0  # longer than run_ranks' timeout: a rank left waiting fails the test


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
