"""Repeated saves of one layout reuse the last global plan: the values travel, the plan does not.

``SafeSavePlanner`` caches by default. A save whose layout (keys, shapes, dtypes, sharding,
flattening) every rank still has sends only its values to the coordinator, which reuses the
global plan and metadata it built before and sends each rank back an empty plan. Checked here
with real saves, in one process and on 2 gloo ranks: the coordinator plans once, what crosses
the collectives shrinks, every save loads back exactly and to its own work directory, any
layout change plans afresh, and the value checks still run on every cached save (divergent
replicated state refused, audit sums current).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import utils as dcp_utils
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, SavePlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcp_safe
from dcp_safe import SafeLoadPlanner, SafeSavePlanner, SafeStorageReader, SafeStorageWriter
from dcp_safe.adapters import plan_cache
from dcp_safe.coordination.group import checkpoint_group
from dcp_safe.errors import ConfigError, DivergentStateError, RestoreMismatchError
from dcp_safe.testing.multiproc import run_ranks

# -- instruments ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with nothing cached (saves without collectives share one process-wide
    cache, which earlier tests filled)."""
    monkeypatch.setattr(plan_cache, "_single_process", plan_cache.PlanCache())


class _Counted:
    """Counts the coordinator's real planning (DCP's global plan builder) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
        self.calls = 0
        original = DefaultSavePlanner.create_global_plan

        def counting(planner: DefaultSavePlanner, plans: list[SavePlan]) -> Any:
            self.calls += 1
            return original(planner, plans)

        if monkeypatch is not None:
            monkeypatch.setattr(DefaultSavePlanner, "create_global_plan", counting)
        else:  # in a spawned rank, for the rest of its life
            DefaultSavePlanner.create_global_plan = counting  # type: ignore[method-assign]


class _Wire:
    """The pickled bytes each rank puts on DCP's plan collectives, per save."""

    def __init__(self) -> None:
        self.gathered: list[int] = []  # what this rank sent the coordinator
        self.scattered: list[int] = []  # what the coordinator sent, all ranks (coordinator only)
        self.items_sent: list[int] = []
        gather, scatter = (
            dcp_utils._DistWrapper.gather_object,
            dcp_utils._DistWrapper.scatter_object,
        )

        def gather_object(wrapper: Any, obj: Any) -> Any:
            if isinstance(obj, SavePlan):  # not the loads' plans, nor the write results
                self.gathered.append(len(pickle.dumps(obj)))
                self.items_sent.append(len(obj.items))
            return gather(wrapper, obj)

        def scatter_object(wrapper: Any, objs: Any) -> Any:
            if objs is not None and isinstance(objs[0], SavePlan):
                self.scattered.append(sum(len(pickle.dumps(o)) for o in objs))
            return scatter(wrapper, objs)

        dcp_utils._DistWrapper.gather_object = gather_object  # type: ignore[method-assign]
        dcp_utils._DistWrapper.scatter_object = scatter_object  # type: ignore[method-assign]


def _save(state: dict[str, Any], root: Path | str, name: str, **planner: Any) -> None:
    kwargs: dict[str, Any] = {"planner": SafeSavePlanner(**planner)} if planner else {}
    dcp_safe.save(state, checkpoint_id=name, storage_writer=SafeStorageWriter(root), **kwargs)


def _load(target: dict[str, Any], root: Path | str, name: str, **kwargs: Any) -> dict[str, Any]:
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root), **kwargs)
    return target


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v)
        if isinstance(v, torch.Tensor)
        else _zeros_like(v)
        if isinstance(v, dict)
        else 0
        for k, v in state.items()
    }


def _state(step: int) -> dict[str, Any]:
    """One layout, new values every step."""
    return {
        "model": {f"w{i}": torch.full((16, 8), float(step * 10 + i)) for i in range(20)},
        "ids": torch.arange(5, dtype=torch.int64) + step,
        "meta": {"step": step},
    }


def _assert_equal(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if isinstance(value, dict):
            _assert_equal(loaded[key], value)
        elif isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


# -- one process ------------------------------------------------------------------------------


def test_repeated_saves_of_one_layout_plan_once_and_each_loads_back_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = _Counted(monkeypatch)
    assignments: list[Any] = []
    write_data = SafeStorageWriter.write_data

    def recording(writer: SafeStorageWriter, plan: SavePlan, planner: Any) -> Any:
        assignments.append(plan.storage_data)
        return write_data(writer, plan, planner)

    monkeypatch.setattr(SafeStorageWriter, "write_data", recording)
    for step in range(1, 5):
        _save(_state(step), tmp_path, f"step_{step}")
    assert planned.calls == 1  # the later three reused the first global plan
    # Each cached save wrote to its own work directory, under its own save id, and committed.
    assert len({a.save_id for a in assignments}) == 4
    assert len({a.work_dir for a in assignments}) == 4
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == [
        f"step_{s}" for s in range(1, 5)
    ]
    for step in range(1, 5):
        saved = _state(step)
        loaded = _load(_zeros_like(saved), tmp_path, f"step_{step}", audit=True)
        _assert_equal(loaded, saved)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: {**s, "extra": torch.ones(2)},  # a new key
        lambda s: {**s, "ids": torch.arange(6, dtype=torch.int64)},  # a shape
        lambda s: {**s, "ids": torch.arange(5, dtype=torch.int32)},  # a dtype alone
        lambda s: {**s, "model": {**s["model"], "w0": torch.ones(16, 8).requires_grad_()}},
        lambda s: {"nested": s},  # the same tensors, flattened under other keys
    ],
    ids=["new-key", "shape", "dtype", "requires-grad", "nesting"],
)
def test_any_layout_change_plans_afresh_and_the_new_layout_is_cached_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Callable[[Any], Any]
) -> None:
    planned = _Counted(monkeypatch)
    _save(_state(1), tmp_path, "a")
    changed = change(_state(2))
    _save(changed, tmp_path, "b")
    assert planned.calls == 2
    _save(change(_state(3)), tmp_path, "c")
    assert planned.calls == 2  # the changed layout is now the cached one
    _assert_equal(_load(_zeros_like(changed), tmp_path, "b"), changed)
    _save(_state(4), tmp_path, "d")  # back to the first layout: planned again, not reused
    assert planned.calls == 3
    _assert_equal(_load(_zeros_like(_state(4)), tmp_path, "d"), _state(4))


def test_two_states_saved_alternately_never_reuse_each_others_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = _Counted(monkeypatch)
    small = {"w": torch.arange(4.0)}
    for step in range(1, 4):
        _save(_state(step), tmp_path / "big", f"step_{step}")
        _save({"w": small["w"] + step}, tmp_path / "small", f"step_{step}")
    assert planned.calls == 6  # one cache per group and configuration: alternating misses
    for step in range(1, 4):
        _assert_equal(
            _load(_zeros_like(_state(step)), tmp_path / "big", f"step_{step}"), _state(step)
        )
        loaded = _load({"w": torch.zeros(4)}, tmp_path / "small", f"step_{step}")
        assert torch.equal(loaded["w"], small["w"] + step)


def test_planners_of_another_configuration_or_with_caching_off_plan_every_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = _Counted(monkeypatch)
    _save(_state(1), tmp_path, "a")
    _save(_state(2), tmp_path, "b", per_rank=["meta"])  # another configuration: its own entry
    _save(_state(3), tmp_path, "c", cache_plans=False)
    _save(_state(4), tmp_path, "d", cache_plans=False)
    assert planned.calls == 4
    _save(_state(5), tmp_path, "e")  # the first configuration's entry is still there
    assert planned.calls == 4
    for name, step in (("c", 3), ("e", 5)):
        _assert_equal(_load(_zeros_like(_state(step)), tmp_path, name), _state(step))


class _Swapping(SafeLoadPlanner):
    """A broken planner: what was saved under "model.w0" lands in "model.w1", and back."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        swap = {"model.w0": "model.w1", "model.w1": "model.w0"}
        index = read_item.dest_index
        if index.fqn in swap:
            index = dataclasses.replace(index, fqn=swap[index.fqn])
            read_item = dataclasses.replace(read_item, dest_index=index)
        return super().resolve_tensor(read_item)


def test_audit_sums_of_a_cached_save_are_its_own(tmp_path: Path) -> None:
    for step in range(1, 4):
        _save(_state(step), tmp_path, f"step_{step}")
    # The first save's sums would not match the third's values: the audit passes on them.
    planner = SafeLoadPlanner()
    _load(_zeros_like(_state(3)), tmp_path, "step_3", planner=planner, audit=True)
    assert "model.w0" in planner.report.audited
    with pytest.raises(RestoreMismatchError, match=r"model\.w0"):
        _load(_zeros_like(_state(3)), tmp_path, "step_3", planner=_Swapping(), audit=True)


def test_cache_plans_is_validated_and_dcps_own_caching_refused() -> None:
    with pytest.raises(ConfigError, match="cache_plans"):
        SafeSavePlanner(cache_plans="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="enable_plan_caching"):
        SafeSavePlanner(enable_plan_caching=True)


def test_a_planner_sent_to_another_process_caches_there_on_its_own(tmp_path: Path) -> None:
    planner = SafeSavePlanner(per_rank=["rng"])
    planner.share_plans_over(None)
    copy = pickle.loads(pickle.dumps(planner))  # what DCP's checkpoint process receives
    assert copy.per_rank == ("rng",) and copy.cache_plans
    dcp_safe.save(
        _state(1), checkpoint_id="a", storage_writer=SafeStorageWriter(tmp_path), planner=copy
    )
    _assert_equal(_load(_zeros_like(_state(1)), tmp_path, "a"), _state(1))


# -- two ranks --------------------------------------------------------------------------------


def _ranked_state(rank: int, world_size: int, step: int, *, split: int = 0) -> dict[str, Any]:
    """Sharded rows (or columns, ``split=1``), replicated plain tensors, a per-rank value."""
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64.0 * 12).reshape(64, 12) + step
    return {
        "emb": distribute_tensor(full, mesh, [Shard(split)]),
        "model": {f"w{i}": torch.full((32, 4), float(step + i)) for i in range(40)},
        "rng": torch.full((3,), float(100 * rank + step)),
    }


def _gathered(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    out["model"] = dict(state["model"])
    return out


def _check_loads(rank: int, world_size: int, root: str, name: str, saved: dict[str, Any]) -> None:
    target = _ranked_state(rank, world_size, -1)
    for value in target["model"].values():
        value.zero_()
    dcp_safe.load(
        target,
        checkpoint_id=name,
        storage_reader=SafeStorageReader(root),
        per_rank=["rng"],
        audit=True,
    )
    _assert_equal(_gathered(target), _gathered(saved))


def _save_ranked(root: str, name: str, state: dict[str, Any]) -> None:
    dcp_safe.save(
        state, checkpoint_id=name, storage_writer=SafeStorageWriter(root), per_rank=["rng"]
    )


def _cached_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    planned, wire = _Counted(), _Wire()
    for step in range(1, 4):
        state = _ranked_state(rank, world_size, step)
        _save_ranked(root, f"step_{step}", state)
        _check_loads(rank, world_size, root, f"step_{step}", state)
    return {
        "planned": planned.calls,
        "gathered": wire.gathered,
        "scattered": wire.scattered,
        "items_sent": wire.items_sent,
    }


@pytest.mark.multiproc
def test_on_two_ranks_cached_saves_send_values_only_and_get_empty_plans_back(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run_ranks(_cached_saves, 2, args=(str(tmp_path),))
    assert rank0["planned"] == 1 and rank1["planned"] == 0  # only the coordinator plans
    for record in (rank0, rank1):
        first, *later = record["items_sent"]
        assert first > 40 and later == [0, 0]  # the items crossed once
        assert all(size < record["gathered"][0] for size in record["gathered"][1:])
    first, *later = rank0["scattered"]
    # Every rank's items came back once; a cached save sends each rank an empty plan and its
    # storage assignment (about 300 bytes a rank, against the first save's thousands).
    assert all(size * 10 < first for size in later), rank0["scattered"]
    assert rank1["scattered"] == []


def _divergent_then_recovered(rank: int, world_size: int, root: str) -> dict[str, Any]:
    planned = _Counted()
    _save_ranked(root, "step_1", _ranked_state(rank, world_size, 1))
    odd = _ranked_state(rank, world_size, 2)
    odd["model"]["w3"] = torch.full((32, 4), float(rank))  # same layout, values differ by rank
    try:
        _save_ranked(root, "step_2", odd)
        refused = None
    except DivergentStateError as exc:
        refused = exc.keys
    state = _ranked_state(rank, world_size, 3)
    _save_ranked(root, "step_3", state)  # the failed save left no rank claiming a cached plan
    _check_loads(rank, world_size, root, "step_3", state)
    return {"refused": refused, "planned": planned.calls}


@pytest.mark.multiproc
def test_divergent_replicated_values_on_a_cached_save_are_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run_ranks(_divergent_then_recovered, 2, args=(str(tmp_path),))
    assert rank0["refused"] == rank1["refused"] == {"model.w3": [[0], [1]]}
    assert rank0["planned"] == 2  # step 3 planned afresh: nothing remembered after step 2 failed
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["step_1", "step_3"]


def _layout_changes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    planned = _Counted()
    steps: list[tuple[str, dict[str, Any]]] = []
    state = _ranked_state(rank, world_size, 1)
    steps.append(("rows", state))
    resharded = _ranked_state(rank, world_size, 2, split=1)  # a sharding change alone
    steps.append(("cols", resharded))
    own = _ranked_state(rank, world_size, 3, split=1)
    if rank == 1:  # one rank's layout changes, the coordinator's does not
        own["rng"] = torch.full((5,), 7.0)
    steps.append(("one_rank", own))
    steps.append(("back", _ranked_state(rank, world_size, 4, split=1)))
    steps.append(("same", _ranked_state(rank, world_size, 5, split=1)))
    counts = []
    for name, step_state in steps:
        _save_ranked(root, name, step_state)
        counts.append(planned.calls)
    for name, step_state in steps:
        if name != "one_rank":
            _check_loads(rank, world_size, root, name, step_state)
    return {"counts": counts}


@pytest.mark.multiproc
def test_a_sharding_change_or_one_ranks_layout_change_plans_afresh(tmp_path: Path) -> None:
    rank0, _ = run_ranks(_layout_changes, 2, args=(str(tmp_path),))
    # rows, cols (resharded), one rank's per-rank shape, back to the cols layout: all planned;
    # the same again: reused.
    assert rank0["counts"] == [1, 2, 3, 4, 4]


def _two_groups(rank: int, world_size: int, root: str) -> dict[str, Any]:
    planned = _Counted()
    groups = {
        name: checkpoint_group(20.0, purpose=f"plan-cache-{name}") for name in ("big", "small")
    }
    states = {
        "big": lambda step: _ranked_state(rank, world_size, step),
        "small": lambda step: {"rng": torch.full((2,), float(step + 10 * rank)), "x": step},
    }
    for step in range(1, 4):
        for name, group in groups.items():
            dcp_safe.save(
                states[name](step),
                checkpoint_id=f"{name}_{step}",
                storage_writer=SafeStorageWriter(root),
                per_rank=["rng"],
                process_group=group,
            )
    _check_loads(rank, world_size, root, "big_3", _ranked_state(rank, world_size, 3))
    small = {"rng": torch.zeros(2), "x": 0}
    dcp_safe.load(
        small, checkpoint_id="small_3", storage_reader=SafeStorageReader(root), per_rank=["rng"]
    )
    return {"planned": planned.calls, "small": (small["rng"].tolist(), small["x"])}


@pytest.mark.multiproc
def test_saves_over_two_groups_in_one_process_each_reuse_their_own_plan(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(_two_groups, 2, args=(str(tmp_path),))
    assert rank0["planned"] == 2  # one plan per group, each reused by its two later saves
    assert rank0["small"] == ([3.0, 3.0], 3) and rank1["small"] == ([13.0, 13.0], 3)
