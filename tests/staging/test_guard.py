"""The mutation guard: a save through BudgetedStager commits the state at the request, or fails.

Real DCP async saves through SafeStorageWriter into real files. ``hold_staging`` makes "an
update during the copy" deterministic; the loops at the end race for real.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import assert_state_equal

from dcp_safe import (
    BudgetedStager,
    SafeStorageReader,
    SafeStorageWriter,
    StagerOptions,
    list_checkpoints,
)
from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.staging.guard import SnapshotGuard
from dcp_safe.testing.staging import hold_staging

MiB = 1 << 20


def _state(n: int = 4, numel: int = 1 << 16) -> dict[str, Any]:
    return {
        "model": {f"layer{i}.weight": torch.full((numel,), float(i)) for i in range(n)},
        "step": 0,
    }


def _load(root: Path, name: str, like: dict[str, Any]) -> dict[str, Any]:
    target = {
        "model": {k: torch.empty_like(v) for k, v in like["model"].items()},
        "step": -1,
    }
    dcp.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root))
    return target


def _save_held(
    root: Path, stager: BudgetedStager, state: dict[str, Any], name: str, update: Callable[[], Any]
) -> Any:
    """Start an async save, run ``update`` before its copy starts, then let the copy run."""
    writer = SafeStorageWriter(root)
    with hold_staging(stager):
        response = dcp.async_save(
            state, checkpoint_id=name, storage_writer=writer, async_stager=stager
        )
        stager.track(response)
        update()
    return response


def test_an_update_before_the_copy_fails_the_save_names_the_tensor_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    state = _state()
    with BudgetedStager() as stager:
        weight = state["model"]["layer2.weight"]
        response = _save_held(tmp_path, stager, state, "torn", lambda: weight.add_(1))

        with pytest.raises(SnapshotMutatedError) as staged:
            response.staging_completion.result(timeout=60)
        with pytest.raises(SnapshotMutatedError) as uploaded:
            response.upload_completion.result(timeout=60)
        assert staged.value.fqns == ("model.layer2.weight",)
        assert uploaded.value.fqns == ("model.layer2.weight",)
        assert staged.value.rank is None
        assert "model.layer2.weight" in str(staged.value)
        assert "staging_completion" in str(staged.value)  # it says what to do
        assert list_checkpoints(tmp_path) == []
        assert not any(tmp_path.iterdir())  # the upload never started
        stats = stager.stats()
        assert (stats.torn, stats.in_flight, stats.in_use_bytes) == (1, 0, 0)

        # The buffers went back to the pool, and the next save works and reuses them.
        expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": 0}
        writer = SafeStorageWriter(tmp_path)
        stager.async_save(
            state, checkpoint_id="next", storage_writer=writer
        ).upload_completion.result(timeout=60)
        assert_state_equal(_load(tmp_path, "next", state), expected)
        assert stager.stats().allocations == stats.allocations


def _adamw_step(param: torch.nn.Parameter) -> None:
    param.grad = torch.ones_like(param)
    torch.optim.AdamW([param], lr=0.1).step()


def _no_grad_add(param: torch.nn.Parameter) -> None:
    with torch.no_grad():
        param.add_(1)


def _through_a_view(param: torch.nn.Parameter) -> None:
    with torch.no_grad():
        param[10:20].mul_(3)


def _resize(param: torch.nn.Parameter) -> None:
    with torch.no_grad():
        param.resize_(7)


def _free_storage(param: torch.nn.Parameter) -> None:
    param.untyped_storage().resize_(0)  # as FSDP frees an unsharded parameter


@pytest.mark.parametrize(
    "update", [_adamw_step, _no_grad_add, _through_a_view, _resize, _free_storage]
)
def test_every_kind_of_update_the_guard_can_see_fails_the_save(
    tmp_path: Path, update: Callable[[torch.nn.Parameter], None]
) -> None:
    # Only an optimizer needs a leaf that requires grad; autograd refuses to resize one.
    param = torch.nn.Parameter(torch.randn(4096), requires_grad=update is _adamw_step)
    state = {"model": {"w": param, "b": torch.zeros(8)}}
    with BudgetedStager() as stager:
        response = _save_held(tmp_path, stager, state, "torn", lambda: update(param))
        with pytest.raises(SnapshotMutatedError) as caught:
            response.upload_completion.result(timeout=60)
    assert caught.value.fqns == ("model.w",)
    assert list_checkpoints(tmp_path) == []


def test_what_the_guard_cannot_see_is_what_the_docs_say() -> None:
    """The torch behaviour docs/staging.md relies on: these updates leave the counter alone."""
    weight = torch.nn.Parameter(torch.randn(64))
    bn = torch.nn.BatchNorm1d(4)
    bn.train()
    guard = SnapshotGuard([weight, bn.running_mean, bn.running_var])

    weight.data.add_(1)  # a write through .data: a new counter over the same storage
    weight.data = torch.zeros(64)  # an assignment to .data: a new storage, the same counter
    bn(torch.randn(8, 4))  # BatchNorm's running statistics, updated in the forward pass

    assert guard.changed() == []
    assert float(bn.running_mean.abs().sum()) > 0  # they did change
    assert float(weight.detach().abs().sum()) == 0
    with torch.no_grad():
        weight.add_(1)
    assert guard.changed() == [weight]


def test_a_guard_off_stager_commits_the_torn_state_the_guard_refuses(tmp_path: Path) -> None:
    """Why the guard is on by default: without it the same update is committed, verified."""
    state = _state()
    weight = state["model"]["layer1.weight"]
    with BudgetedStager(options=StagerOptions(mutation_guard=False)) as stager:
        response = _save_held(tmp_path, stager, state, "torn", lambda: weight.add_(5))
        response.upload_completion.result(timeout=60)
    loaded = _load(tmp_path, "torn", state)
    assert torch.equal(loaded["model"]["layer1.weight"], torch.full_like(weight, 6.0))
    assert [info.name for info in list_checkpoints(tmp_path)] == ["torn"]


def _counts_of_racing_saves(
    root: Path, saves: int, update: Callable[[dict[str, Any]], None], wait_staging: bool
) -> dict[str, int]:
    """``saves`` raw async saves, each followed at once by ``update``; classify what committed.

    ``in_flight``: exactly one tensor differs. That is the guard's documented limit (an update
    still executing when the copy ends, e.g. a thread the OS preempted inside the kernel, bumps
    its counter only after the check); it can touch only the tensor that one update writes.
    ``torn``: more than one differs, which the guard must never let through.
    """
    state = _state(n=16, numel=MiB // 4)  # 16 MiB: the copy takes long enough to race
    outcomes = {"exact": 0, "in_flight": 0, "torn": 0, "refused": 0}
    with BudgetedStager() as stager:
        for step in range(saves):
            for tensor in state["model"].values():
                tensor.fill_(float(step))
            writer = SafeStorageWriter(root)
            response = stager.async_save(state, checkpoint_id=f"s{step}", storage_writer=writer)
            if wait_staging:
                response.staging_completion.result(timeout=60)
            update(state)
            try:
                response.upload_completion.result(timeout=60)
            except SnapshotMutatedError:
                outcomes["refused"] += 1
                continue
            loaded = _load(root, f"s{step}", state)
            wrong = sum(not torch.all(t == float(step)) for t in loaded["model"].values())
            outcomes[("exact", "in_flight")[wrong] if wrong < 2 else "torn"] += 1
    return outcomes


def _add_one(state: dict[str, Any]) -> None:
    for tensor in state["model"].values():
        tensor.add_(1)


def test_raw_async_saves_updated_without_the_staging_wait_are_exact_or_refused(
    tmp_path: Path,
) -> None:
    outcomes = _counts_of_racing_saves(tmp_path, 20, _add_one, wait_staging=False)
    assert outcomes["torn"] == 0, outcomes
    assert outcomes["exact"] + outcomes["in_flight"] + outcomes["refused"] == 20
    assert len(list_checkpoints(tmp_path)) == outcomes["exact"] + outcomes["in_flight"]


def test_raw_async_saves_with_the_staging_wait_are_all_exact(tmp_path: Path) -> None:
    outcomes = _counts_of_racing_saves(tmp_path, 20, _add_one, wait_staging=True)
    assert outcomes == {"exact": 20, "in_flight": 0, "torn": 0, "refused": 0}


def _consistent(values: list[float]) -> bool:
    """Whether tensor values could be one moment of an updater adding 1 to each tensor in turn:
    non-increasing in update order, at most one round apart."""
    ordered = all(a >= b for a, b in itertools.pairwise(values))
    return ordered and max(values) - min(values) <= 1


def test_a_thread_updating_the_state_during_saves_never_gets_a_torn_commit(
    tmp_path: Path,
) -> None:
    """A background thread adds 1 to every tensor, one after another, without pause. A commit
    must be one moment of that loop, except at most the one tensor whose update was still
    executing when the copy ended (the guard's documented limit: a thread preempted inside its
    kernel bumps the counter only after the check)."""
    state = {"model": {f"layer{i}.weight": torch.zeros(MiB // 2) for i in range(8)}}
    stop = threading.Event()

    def keep_updating() -> None:
        while not stop.is_set():
            for tensor in state["model"].values():
                tensor.add_(1)

    outcomes = {"committed": 0, "refused": 0}
    updater = threading.Thread(target=keep_updating, daemon=True)
    updater.start()
    try:
        with BudgetedStager() as stager:
            for step in range(12):
                writer = SafeStorageWriter(tmp_path)
                response = stager.async_save(state, checkpoint_id=f"s{step}", storage_writer=writer)
                try:
                    response.upload_completion.result(timeout=60)
                except SnapshotMutatedError:
                    outcomes["refused"] += 1
                    continue
                outcomes["committed"] += 1
                target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
                dcp.load(
                    target, checkpoint_id=f"s{step}", storage_reader=SafeStorageReader(tmp_path)
                )
                tensors = list(target["model"].values())
                uniform = [bool(torch.all(t == t[0])) for t in tensors]
                firsts = [float(t[0]) for t in tensors]
                # Drop each tensor in turn: the rest must be one consistent moment.
                assert any(
                    all(uniform[:i] + uniform[i + 1 :])
                    and _consistent(firsts[:i] + firsts[i + 1 :])
                    for i in range(len(tensors))
                ), f"s{step}: {firsts}, uniform {uniform}"
    finally:
        stop.set()
        updater.join()
    assert outcomes["refused"] > 0, outcomes  # the updater never pauses: copies race it
    assert outcomes["committed"] + outcomes["refused"] == 12
