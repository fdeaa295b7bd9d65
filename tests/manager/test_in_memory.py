"""``CheckpointManager.rollback`` with ``Resume(keep_in_memory=True)``: the last committed step,
from host memory.

A model, its AdamW state and plain values train for three more steps after a commit; a rollback
brings back exactly the committed step, reading nothing from storage (every read of every backend
fails meanwhile), and is checked against the committed manifest before anything is copied.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ready_worker
from torch import nn

from dcp_safe import (
    Bounds,
    CheckpointCorruptError,
    CheckpointManager,
    ConfigError,
    Resume,
    Runtime,
    SavePolicy,
)
from dcp_safe.backends.backend import Backend
from dcp_safe.errors import BudgetExceededError, MissingKeysError, RollbackUnavailableError
from dcp_safe.manager.fallback import FallbackOptions
from dcp_safe.staging import MemoryBudget
from dcp_safe.testing.multiproc import run_ranks

MiB = 1 << 20
KEEP = Resume(keep_in_memory=True)


class _Job:
    """A tiny training job whose whole state a manager saves."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.extra: dict[str, Any] = {"step": 0, "seen": [], "tag": "run"}
        self.state = {"model": self.model, "optim": self.optim, "extra": self.extra}

    def train(self, step: int) -> None:
        self.model(torch.randn(8, 16)).pow(2).sum().backward()
        self.optim.step()
        self.optim.zero_grad()
        self.extra["step"] = step
        self.extra["seen"].append(step)

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optim": copy.deepcopy(self.optim.state_dict()),
            "extra": copy.deepcopy(self.extra),
        }


def _assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, list):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual == expected


def _fail_every_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every read of every backend fail; return the paths that were tried."""
    tried: list[str] = []

    def refuse(self: Backend, rel: str, *args: Any, **kwargs: Any) -> Any:
        tried.append(rel)
        raise OSError(f"reads are off in this test: {rel}")

    classes, todo = [], [Backend]
    while todo:  # every backend class: each may override what it reads with
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        for method in ("open_read", "read_bytes", "read_small", "stat", "sizes", "list_dir"):
            if method in vars(cls):
                monkeypatch.setattr(cls, method, refuse)
    return tried


def _train_and_commit(manager: CheckpointManager, job: _Job, steps: range) -> None:
    for step in steps:
        job.train(step)
        handle = manager.save(step, job.state)
        assert handle is not None
        handle.committed.result(timeout=60)


def test_rollback_restores_the_last_committed_step_without_reading_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job()
    with CheckpointManager(tmp_path, resume=KEEP) as manager:
        _train_and_commit(manager, job, range(1, 4))
        committed = job.snapshot()
        for step in range(4, 7):  # three more steps, not saved
            job.train(step)
        assert not torch.equal(job.model[0].weight, committed["model"]["0.weight"])

        tried = _fail_every_read(monkeypatch)
        assert manager.rollback(job.state) == 3
        assert tried == []
        _assert_same(job.model.state_dict(), committed["model"])
        _assert_same(job.optim.state_dict(), committed["optim"])
        _assert_same(job.extra, committed["extra"])
        with pytest.raises(OSError, match="reads are off"):  # the patch does bite a restore
            manager.restore(job.state)
        monkeypatch.undo()
        assert [e["step"] for e in manager.history() if e["event"] == "rolled_back"] == [3]

        # Training goes on from the rolled-back state: the next save and rollback work as before.
        _train_and_commit(manager, job, range(4, 5))
        job.train(5)
        assert manager.rollback(job.state) == 4


def test_rolled_back_values_are_copies_not_the_kept_buffers(tmp_path: Path) -> None:
    job = _Job()
    with CheckpointManager(tmp_path, resume=KEEP) as manager:
        _train_and_commit(manager, job, range(1, 2))
        manager.rollback(job.state)
        job.extra["seen"].append("live only")
        job.model[0].weight.data.add_(1.0)
        job.train(2)
        assert manager.rollback(job.state) == 1  # the kept copy did not follow the live state
        assert job.extra["seen"] == [1]


def test_a_kept_copy_that_changed_is_refused_and_nothing_is_copied(tmp_path: Path) -> None:
    job = _Job()
    with CheckpointManager(tmp_path, resume=KEEP) as manager:
        _train_and_commit(manager, job, range(1, 2))
        job.train(2)
        live = job.snapshot()
        kept = manager.stager.kept()
        assert kept is not None
        kept[1]["model"]["2.bias"][0] += 1.0  # a bit flip in host memory, say
        with pytest.raises(CheckpointCorruptError, match="changed since it was committed"):
            manager.rollback(job.state)
        _assert_same(job.model.state_dict(), live["model"])
        _assert_same(job.extra, live["extra"])


def test_a_changed_kept_object_is_refused_too(tmp_path: Path) -> None:
    job = _Job()
    with CheckpointManager(tmp_path, resume=KEEP) as manager:
        _train_and_commit(manager, job, range(1, 2))
        kept = manager.stager.kept()
        assert kept is not None
        kept[1]["extra"]["tag"] = "tampered"  # objects are checked against their digest
        with pytest.raises(CheckpointCorruptError, match=r"extra\.tag"):
            manager.rollback(job.state)


def test_rollback_needs_keep_in_memory_and_a_kept_commit(tmp_path: Path) -> None:
    job = _Job()
    with CheckpointManager(tmp_path / "plain") as manager:
        _train_and_commit(manager, job, range(1, 2))
        with pytest.raises(ConfigError, match="keep_in_memory=True"):
            manager.rollback(job.state)
    with (
        CheckpointManager(tmp_path / "kept", resume=KEEP) as manager,
        pytest.raises(RollbackUnavailableError, match="restore"),
    ):
        manager.rollback(job.state)  # nothing committed yet


def test_a_state_with_keys_the_kept_copy_lacks_is_refused(tmp_path: Path) -> None:
    job = _Job()
    with CheckpointManager(tmp_path, resume=KEEP) as manager:
        _train_and_commit(manager, job, range(1, 2))
        grown = {**job.state, "scheduler": {"last_epoch": 3}}
        with pytest.raises(MissingKeysError, match="scheduler"):
            manager.rollback(grown)


def test_a_budget_that_cannot_hold_two_copies_is_refused_clearly(tmp_path: Path) -> None:
    job = _Job()
    need = sum(t.nbytes for t in job.model.parameters())
    budget = MemoryBudget(usable_bytes=int(1.5 * need), reserve_bytes=0)
    with CheckpointManager(tmp_path, resume=KEEP, bounds=Bounds(budget=budget)) as manager:
        job.train(1)
        with pytest.raises(BudgetExceededError, match="keep_in_memory=True"):
            manager.save(1, {"model": job.model})


def test_a_synchronous_save_drops_the_kept_copy(tmp_path: Path) -> None:
    job = _Job()
    free = iter([1 << 40])  # then none: the memory trigger trips, saves turn synchronous
    with CheckpointManager(
        tmp_path,
        policy=SavePolicy(sync_fallback=FallbackOptions(memory_crossings=1)),
        resume=KEEP,
        runtime=Runtime(memory_sampler=lambda: next(free, 0)),
    ) as manager:
        _train_and_commit(manager, job, range(1, 3))
        assert manager.stats().sync_saves == 1
        with pytest.raises(RollbackUnavailableError):
            manager.rollback(job.state)  # step 1's copy is not the last committed step
        assert manager.stager.kept() is None


# -- several ranks ---------------------------------------------------------------------------


def _ranks_roll_back(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    weight = torch.randn(8, 8)
    state: dict[str, Any] = {"w": weight.clone(), "rng": {"rank": rank, "draws": [rank]}}
    resume = Resume(per_rank=("rng",), keep_in_memory=True)
    with CheckpointManager(root, resume=resume) as manager:
        for step in (1, 2):
            state["w"].add_(1.0)
            state["rng"]["draws"].append(step * 10 + rank)
            handle = manager.save(step, state)
            assert handle is not None
            handle.committed.result(timeout=60)
        expected = copy.deepcopy(state)
        state["w"].mul_(3.0)
        state["rng"]["draws"].append(-1)
        step = manager.rollback(state)
    return {
        "step": step,
        "same_w": torch.equal(state["w"], expected["w"]),
        "rng": state["rng"],
        "expected_rng": expected["rng"],
    }


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_every_rank_rolls_back_to_the_same_step_with_its_own_per_rank_state(
    tmp_path: Path,
) -> None:
    results = run_ranks(_ranks_roll_back, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, result in enumerate(results):
        assert result["step"] == 2 and result["same_w"]
        assert (
            result["rng"]
            == result["expected_rng"]
            == {"rank": rank, "draws": [rank, 10 + rank, 20 + rank]}
        )


def test_rollback_after_saves_written_by_the_worker_process(tmp_path: Path) -> None:
    """The worker writes with the same template (one serialization id in every process), so
    the parent checks its kept copy against what the worker committed."""
    job = _Job()
    with CheckpointManager(tmp_path, resume=KEEP, runtime=Runtime(executor="process")) as manager:
        ready_worker(manager)
        _train_and_commit(manager, job, range(1, 3))
        committed = job.snapshot()
        job.train(3)
        assert manager.rollback(job.state) == 2
        _assert_same(job.model.state_dict(), committed["model"])
        _assert_same(job.extra, committed["extra"])
