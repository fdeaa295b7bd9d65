"""CheckpointManager: a committed checkpoint is exactly the state at ``save()``, or the save fails.

The README's loop calls ``maybe_save`` and goes straight on to the optimizer step. These tests
run that loop with real models, real DCP saves and real files, and compare every committed
checkpoint with a copy of the state taken just before ``save()`` was called.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, differing_tensors

from dcp_safe import CheckpointManager, SavePolicy, list_checkpoints
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.history import History
from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.testing.staging import hold_staging

SAVES = 20


def _model(width: int = 1024, depth: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _blank(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, float("nan")) if value.is_floating_point() else value * 0
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    return value


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(16, model[0].in_features)).square().mean().backward()


def _update(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()  # in place: AdamW's step, exp_avg, exp_avg_sq and every parameter
    optimizer.zero_grad()


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    _backward(model)
    _update(optimizer)


def _history(root: Path) -> list[dict[str, Any]]:
    return History(open_backend(str(root))).read()


def _run_readme_loop(root: Path, staging: str, wait_staged: bool) -> dict[str, int]:
    """SAVES saves, each followed at once by the optimizer step; check each commit exactly.

    The loop saves between backward and the optimizer step, so the in-place update starts the
    moment ``save()`` returns (72 MiB of parameters and AdamW state in 18 tensors): with a
    ``save()`` that returned before the copy, most of these commits were torn.
    """
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    _train_step(model, optimizer)  # so the optimizer has state to save
    # in_flight: exactly one tensor differs, the guard's documented limit (an update still
    # executing when the copy ended); torn: more than one, which must never commit.
    outcomes = {"exact": 0, "in_flight": 0, "torn": 0, "refused": 0}
    ckpt = CheckpointManager(root, keep_last=2, policy=SavePolicy(staging=staging))
    try:
        for step in range(1, SAVES + 1):
            _backward(model)
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            expected = _clone(state)
            handle = ckpt.save(step, state)
            assert handle is not None
            if staging == "snapshot":
                assert handle.staged.done()  # the copy is taken before save() returns
            if wait_staged:
                ckpt.wait_staged()
            _update(optimizer)  # straight on, as the README loop goes
            try:
                name = handle.committed.result(timeout=120)
            except SnapshotMutatedError:
                outcomes["refused"] += 1
                continue
            loaded = _blank(expected)
            ckpt.restore(loaded, step)
            wrong = differing_tensors(loaded, expected, where=name)
            outcomes[("exact", "in_flight")[len(wrong)] if len(wrong) < 2 else "torn"] += 1
        ckpt.close()
    except SnapshotMutatedError:
        pass  # close() raises the first refused save; its count is already in outcomes
    return outcomes


def test_the_readme_loop_with_the_defaults_commits_exactly_the_state_at_every_save(
    tmp_path: Path,
) -> None:
    outcomes = _run_readme_loop(tmp_path, staging="snapshot", wait_staged=False)
    assert outcomes == {"exact": SAVES, "in_flight": 0, "torn": 0, "refused": 0}
    assert len(list_checkpoints(tmp_path)) == 2  # keep_last=2


def test_overlap_staging_without_a_wait_commits_exact_states_or_fails_typed(
    tmp_path: Path,
) -> None:
    outcomes = _run_readme_loop(tmp_path, staging="overlap", wait_staged=False)
    assert outcomes["torn"] == 0, outcomes
    assert outcomes["exact"] + outcomes["in_flight"] + outcomes["refused"] == SAVES
    failed = [e for e in _history(tmp_path) if e["event"] == "failed"]
    assert len(failed) == outcomes["refused"]
    assert all("SnapshotMutatedError" in e["reason"] for e in failed)


def test_overlap_staging_with_wait_staged_commits_every_save_exactly(tmp_path: Path) -> None:
    outcomes = _run_readme_loop(tmp_path, staging="overlap", wait_staged=True)
    assert outcomes == {"exact": SAVES, "in_flight": 0, "torn": 0, "refused": 0}


def test_a_batchnorm_model_trained_right_after_save_commits_the_running_stats_of_save(
    tmp_path: Path,
) -> None:
    """BatchNorm's forward updates running stats without a version bump: the guard cannot see
    it, so only the default staging (copy before save() returns) keeps it exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 256)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    with CheckpointManager(tmp_path, keep_last=SAVES) as ckpt:
        for step in range(1, SAVES + 1):
            state = {"model": model.state_dict()}
            expected = _clone(state)
            handle = ckpt.save(step, state)
            assert handle is not None
            _train_step(model, optimizer)  # forward in train mode: running stats move
            handle.committed.result(timeout=120)
            loaded = _blank(expected)
            ckpt.restore(loaded, step)
            assert_state_equal(loaded, expected, where=f"step {step}")
            assert not torch.equal(loaded["model"]["1.running_mean"], model[1].running_mean)


def test_another_thread_updating_the_state_during_the_copy_fails_that_save_only(
    tmp_path: Path,
) -> None:
    state = {"w": torch.zeros(1 << 16), "b": torch.zeros(8)}
    with CheckpointManager(tmp_path, keep_last=5) as ckpt:
        returned: list[Any] = []
        with hold_staging(ckpt.stager):
            saver = threading.Thread(target=lambda: returned.append(ckpt.save(1, state)))
            saver.start()
            deadline = time.monotonic() + 60
            while ckpt.stager.stats().admitted < 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # save(1) is blocked in its copy
            state["w"].add_(1)  # another thread's in-place update, during the copy
        saver.join(60)
        [handle] = returned
        with pytest.raises(SnapshotMutatedError) as caught:
            handle.committed.result(timeout=60)
        assert caught.value.fqns == ("w",)

        second = ckpt.save(2, state)  # the next save works
        assert second is not None
        assert second.committed.result(timeout=60) == "step_000000002"
        with pytest.raises(SnapshotMutatedError):
            ckpt.wait()  # the failure was kept for the caller, once
        ckpt.wait()
    assert [i.name for i in list_checkpoints(tmp_path)] == ["step_000000002"]
    events = [(e["event"], e["name"]) for e in _history(tmp_path)]
    assert ("failed", "step_000000001") in events
    assert ("committed", "step_000000002") in events
    assert ckpt.stager.stats().torn == 1


def test_staging_mode_is_validated(tmp_path: Path) -> None:
    from dcp_safe import ConfigError

    with pytest.raises(ConfigError, match="staging must be one of 'snapshot', 'overlap'"):
        CheckpointManager(tmp_path, policy=SavePolicy(staging="lazy"))
