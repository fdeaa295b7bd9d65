"""One ``CheckpointManager`` per rank under a real gloo group: one checkpoint per step, one policy.

Each test launches real ranks with ``run_ranks`` (as ``torchrun`` would: the default group is
initialized before the manager exists) and builds the manager with the same arguments a single
process uses, no extra ones. Checked: every saved step is one multi-rank checkpoint (DTensor and
FSDP2 state, sharded over the ranks), retention is exact on the shared root, restore is exact on
the same ranks and resharded (4 -> 2 -> 1); the ranks take identical decisions when only one of
them is slow or short of memory; a rank killed mid-save is named to the survivors by a
``CommitError``; SIGTERM to every rank commits one coordinated final save.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, gather_full
from support.faults import DiesMidWrite, SlowOnRank
from support.training import app_state
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_safe import (
    Bounds,
    CheckpointManager,
    CommitError,
    Retention,
    Runtime,
    SavePolicy,
    list_checkpoints,
)
from dcp_safe.manager.fallback import FallbackOptions
from dcp_safe.testing.multiproc import RankFailedError, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

DEADLINE_S = 20.0


# -- state builders (module level: ranks import them by reference) ----------------------------


def _dtensor_state(world_size: int, seed: int) -> dict[str, Any]:
    """A row-sharded weight, a column-sharded one and a replicated bias, all DTensors."""
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(seed)
    return {
        "w_rows": distribute_tensor(torch.randn(8, 6, generator=gen), mesh, [Shard(0)]),
        "w_cols": distribute_tensor(torch.randn(6, 8, generator=gen), mesh, [Shard(1)]),
        "bias": distribute_tensor(torch.randn(6, generator=gen), mesh, [Replicate()]),
        "meta": {"seed": seed},
    }


def _fsdp_net(world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _train_step(net: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _comparable(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Events as (event, step, tier, reason) with the rank-specific words taken out."""
    return [(e["event"], e["step"], e.get("tier")) for e in events]


# -- rank bodies ----------------------------------------------------------------------------


def _save_six_then_restore(rank: int, world_size: int, root: str) -> dict[str, Any]:
    saved: dict[int, Any] = {}
    with CheckpointManager(
        root,
        keep_last=2,
        retention=Retention(keep_every=3),
        bounds=Bounds(deadline_s=DEADLINE_S),
    ) as manager:
        for step in range(1, 7):
            state = _dtensor_state(world_size, seed=step)
            saved[step] = gather_full(state)
            handle = manager.save(step, state)
            assert handle is not None
            handle.committed.result(timeout=120)
        target = _dtensor_state(world_size, seed=99)
        loaded = manager.restore(target)
        named = _dtensor_state(world_size, seed=98)
        manager.restore(named, step=3)
        decisions = manager.decisions()
        stats = manager.stats()
    return {
        "loaded": loaded,
        "latest_state": gather_full(target),
        "step3_state": gather_full(named),
        "saved": saved,
        "decisions": _comparable(decisions),
        "committed": stats.committed,
        "history": manager.history(),
    }


def _fsdp_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    net, optimizer = _fsdp_net(world_size)
    with CheckpointManager(root, keep_last=1, bounds=Bounds(deadline_s=DEADLINE_S)) as manager:
        for step in range(1, 4):
            _train_step(net, optimizer, step)
            manager.save(step, app_state(net, optimizer))
    return gather_full(app_state(net, optimizer))


def _fsdp_restore(rank: int, world_size: int, root: str) -> dict[str, Any]:
    net, optimizer = _fsdp_net(world_size)
    state = app_state(net, optimizer)
    with CheckpointManager(root, keep_last=1, bounds=Bounds(deadline_s=DEADLINE_S)) as manager:
        name = manager.restore(state)
    set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"name": name, "state": gather_full(app_state(net, optimizer))}


def _skip_with_one_slow_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # A delay well above a save() call on a loaded host, so saves do overlap the slow one.
    writer = SlowOnRank(root, slow_rank=1, delay_s=1.0)
    manager = CheckpointManager(
        root,
        when_busy="skip",
        bounds=Bounds(deadline_s=DEADLINE_S),
        runtime=Runtime(writer=writer),
    )
    returned = []
    for step in range(1, 13):
        state = {f"rank{rank}.w": torch.full((256, 256), float(step))}  # each rank writes its own
        returned.append(manager.save(step, state) is not None)
        time.sleep(0.05)
    manager.close(timeout_s=120)
    stats = manager.stats()
    return {
        "returned": returned,
        "decisions": _comparable(manager.decisions()),
        "skipped": stats.skipped,
        "peak_bytes": manager.stager.stats().peak_pool_bytes,
        "envelope": manager.stager.budget.envelope_bytes,
    }


def _fallback_on_one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    low = {"n": 0}

    def memory() -> int:  # rank 1 dips under the reserve at every request
        low["n"] += 1
        return 0 if rank == 1 and low["n"] % 2 == 0 else 1 << 50

    manager = CheckpointManager(
        root,
        policy=SavePolicy(sync_fallback=FallbackOptions(memory_crossings=2)),
        bounds=Bounds(deadline_s=DEADLINE_S),
        runtime=Runtime(memory_sampler=memory),
    )
    for step in range(1, 7):
        manager.save(step, {"w": torch.full((64,), float(step))})
        manager.wait(timeout_s=120)
    manager.close(timeout_s=120)
    stats = manager.stats()
    return {
        "fallback_reason": stats.fallback_reason,
        "sync_saves": stats.sync_saves,
        "decisions": _comparable(manager.decisions()),
    }


def _killed_mid_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    writer = DiesMidWrite(root, victim=1, at_step=2)
    manager = CheckpointManager(root, bounds=Bounds(deadline_s=8.0), runtime=Runtime(writer=writer))
    manager.save(1, {f"rank{rank}.w": torch.full((32,), 1.0)})  # not deduplicated: own keys
    manager.wait(timeout_s=60)
    handle = manager.save(2, {f"rank{rank}.w": torch.full((32,), 2.0)})
    assert handle is not None
    try:
        handle.committed.result(timeout=120)
        error: Any = None
    except CommitError as exc:
        error = {"type": type(exc).__name__, "failures": exc.failures, "message": str(exc)}
    with pytest.raises(CommitError):  # the kept error reaches close() too
        manager.close(timeout_s=60)
    return {"error": error, "listed": [c.name for c in list_checkpoints(root)]}


def _sigterm_everywhere(rank: int, world_size: int, root: str) -> dict[str, Any]:
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    writer = SlowOnRank(root, slow_rank=rank, delay_s=0.3)  # every rank slow: step 3 skips
    manager = CheckpointManager(
        root,
        when_busy="skip",
        bounds=Bounds(deadline_s=DEADLINE_S),
        runtime=Runtime(writer=writer),
    )
    handler = manager.install_preemption_handler(budget_s=60)
    state = {"w": torch.full((64,), 1.0)}
    manager.save(1, state)
    manager.wait(timeout_s=60)
    state["w"].fill_(2.0)
    manager.save(2, state)
    state["w"].fill_(3.0)
    skipped = manager.save(3, state) is None  # step 2 still in flight on every rank
    os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends every rank
    time.sleep(0.1)  # the handler runs on this thread between bytecodes
    outcome = handler.outcome
    manager.close(timeout_s=60)
    return {"skipped": skipped, "outcome": outcome, "chained": seen, "history": manager.history()}


# -- the specifications -----------------------------------------------------------------------


def test_each_step_is_one_multirank_checkpoint_and_retention_is_exact(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    results = run_ranks(_save_six_then_restore, 2, args=(root,), timeout_s=240)
    # keep_last=2 keeps 5 and 6; keep_every=3 keeps 3 and 6.
    assert [c.name for c in list_checkpoints(root)] == [
        "step_000000003",
        "step_000000005",
        "step_000000006",
    ]
    assert results[0]["decisions"] == results[1]["decisions"]
    for result in results:
        assert result["loaded"] == "step_000000006"
        assert_state_equal(result["latest_state"], result["saved"][6])
        assert_state_equal(result["step3_state"], result["saved"][3])
        assert result["committed"] == 6
    committed = [e["step"] for e in results[0]["history"] if e["event"] == "committed"]
    assert committed == [1, 2, 3, 4, 5, 6]  # written once, by the coordinator
    # 2 -> 1: one process without a group loads the sharded checkpoint whole.
    saved = results[0]["saved"][6]
    whole = {k: torch.zeros_like(v) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    whole["meta"] = {"seed": -1}
    with CheckpointManager(root, keep_last=2, retention=Retention(keep_every=3)) as manager:
        assert manager.restore(whole) == "step_000000006"
    assert_state_equal(whole, saved)


def test_fsdp2_state_restores_resharded_four_to_two_to_one(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_fsdp_save, 4, args=(root,), timeout_s=240)[0]
    # keep_last=1, and retention's safety rule keeps the two newest validated ones.
    assert [c.name for c in list_checkpoints(root)] == ["step_000000002", "step_000000003"]
    restored = run_ranks(_fsdp_restore, 2, args=(root,), timeout_s=240)
    for result in restored:
        assert result["name"] == "step_000000003"
        assert_state_equal(result["state"], saved)
    # One process, no group: the plain tensors of the whole model.
    whole = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    with CheckpointManager(root, keep_last=1) as manager:
        assert manager.restore(whole) == "step_000000003"
    assert_state_equal(whole["model"], saved["model"])


def test_skip_decisions_are_identical_when_storage_is_slow_on_one_rank(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    results = run_ranks(_skip_with_one_slow_rank, 2, args=(root,), timeout_s=240)
    assert results[0]["returned"] == results[1]["returned"]
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["skipped"] > 0  # the slow rank's saves outlast the save interval
    assert results[0]["skipped"] == results[1]["skipped"]
    for result in results:
        assert result["peak_bytes"] <= result["envelope"]
    committed = {c.name for c in list_checkpoints(root)}
    assert committed  # the last ones committed, as multi-rank checkpoints


def test_a_fallback_on_one_rank_switches_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    results = run_ranks(_fallback_on_one_rank, 2, args=(root,), timeout_s=240)
    assert "host available memory fell below the reserve" in results[1]["fallback_reason"]
    assert "peers fell back: rank 1" in results[0]["fallback_reason"]
    assert results[0]["sync_saves"] == results[1]["sync_saves"] > 0
    assert results[0]["decisions"] == results[1]["decisions"]


def test_a_rank_killed_during_a_manager_save_is_named_to_the_survivor(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with pytest.raises(RankFailedError) as caught:
        run_ranks(_killed_mid_save, 2, args=(root,), timeout_s=240, failure_grace_s=90)
    survivor = caught.value.results[0]
    assert survivor["error"]["type"] == "CommitError"
    assert 1 in survivor["error"]["failures"]
    assert "within the 8 s deadline" in survivor["error"]["message"]
    assert survivor["listed"] == ["step_000000001"]  # the previous checkpoint, intact


def test_sigterm_on_every_rank_commits_one_coordinated_final_save(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    results = run_ranks(_sigterm_everywhere, 2, args=(root,), timeout_s=240)
    for result in results:
        assert result["skipped"]
        assert result["chained"] == [signal.SIGTERM]
        assert "final synchronous save of step 3 committed" in result["outcome"]
    assert "step_000000003" in [c.name for c in list_checkpoints(root)]
    state = {"w": torch.zeros(64)}
    with CheckpointManager(root) as manager:
        assert manager.restore(state) == "step_000000003"
    assert torch.equal(state["w"], torch.full((64,), 3.0))
