"""Per-layout staging plans: reused while the layout holds, rebuilt (right bytes) when it moves."""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.staging import BudgetedStager, MemoryBudget, StagerOptions
from dcp_safe.staging._tree import scan
from dcp_safe.staging.plan import holds_its_bytes
from dcp_safe.staging.pool import BufferPool
from dcp_safe.testing.staging import hold_staging

MiB = 1 << 20
# Pageable buffers even where CUDA is available: pinning is not what these tests check.
CPU = StagerOptions(pin_memory="off")


def _budget() -> MemoryBudget:
    return MemoryBudget(usable_bytes=512 * MiB, reserve_bytes=0, available_bytes=512 * MiB)


def _state(n: int = 6) -> dict[str, Any]:
    return {
        "model": {f"layers.{i}.weight": torch.full((256,), float(i)) for i in range(n)},
        "step": 3,
    }


def _stage(stager: BudgetedStager, state: dict[str, Any]) -> dict[str, Any]:
    """Stage ``state``; the caller drops the result before staging again (one in flight)."""
    _settle(stager)
    staged: dict[str, Any] = stager.stage(state).result()
    return staged


def _settle(stager: BudgetedStager) -> None:
    # A dropped staged dict is released on the staging thread; let that run first.
    stager.run_on_staging_thread(lambda: None).result()


def _same(staged: Any, live: Any) -> bool:
    if isinstance(live, torch.Tensor):
        return (
            isinstance(staged, torch.Tensor)
            and staged.dtype == live.dtype
            and staged.shape == live.shape
            and torch.equal(staged, live)
        )
    if isinstance(live, dict):
        return staged.keys() == live.keys() and all(_same(staged[k], live[k]) for k in live)
    return bool(staged == live)


def test_plan_and_views_are_reused_while_the_layout_is_unchanged() -> None:
    state = _state()
    with BudgetedStager(_budget(), options=CPU) as stager:
        first = _stage(stager, state)
        pointers = [t.data_ptr() for t in first["model"].values()]
        del first
        for step in range(3):
            for tensor in state["model"].values():
                tensor.add_(1.0)
            state["step"] = step
            staged = _stage(stager, state)
            assert _same(staged, state)
            assert [t.data_ptr() for t in staged["model"].values()] == pointers
            del staged
        s = stager.stats()
        assert (s.plans_built, s.plan_reuses) == (1, 3)
        assert s.allocations == len(state["model"])


def _change_shape(state: dict[str, Any]) -> None:
    state["model"]["layers.0.weight"] = torch.arange(512, dtype=torch.float32)


def _change_dtype(state: dict[str, Any]) -> None:
    # Same byte size: the pool's buffer fits, but the view must be rebuilt.
    state["model"]["layers.1.weight"] = torch.arange(256, dtype=torch.int32)


def _add_key(state: dict[str, Any]) -> None:
    state["model"]["extra.bias"] = torch.full((7,), 9.0)


def _remove_key(state: dict[str, Any]) -> None:
    del state["model"]["layers.2.weight"]


def _rename_key(state: dict[str, Any]) -> None:
    state["model"]["renamed"] = state["model"].pop("layers.3.weight")


def _alias(state: dict[str, Any]) -> None:
    state["model"]["layers.4.weight"] = state["model"]["layers.5.weight"]


def _to_view(state: dict[str, Any]) -> None:
    state["model"]["layers.0.weight"] = torch.arange(512, dtype=torch.float32)[::2]


@pytest.mark.parametrize(
    "change",
    [_change_shape, _change_dtype, _add_key, _remove_key, _rename_key, _alias],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_layout_change_builds_a_new_plan_with_the_right_bytes(
    change: Callable[[dict[str, Any]], None],
) -> None:
    state = _state()
    with BudgetedStager(_budget(), options=CPU) as stager:
        for _ in range(2):
            staged = _stage(stager, state)
            del staged
        change(state)
        staged = _stage(stager, state)
        assert _same(staged, state)
        assert stager.stats().plans_built == 2
        if change is _alias:
            model = staged["model"]
            assert model["layers.4.weight"] is model["layers.5.weight"]
        del staged
        again = _stage(stager, state)  # the new layout's plan is reused in turn
        assert _same(again, state) and stager.stats().plans_built == 2
        del again


def test_a_non_contiguous_source_is_staged_contiguous_with_its_values() -> None:
    state = _state()
    _to_view(state)
    with BudgetedStager(_budget(), options=CPU) as stager:
        for _ in range(2):
            staged = _stage(stager, state)
            assert _same(staged, state) and staged["model"]["layers.0.weight"].is_contiguous()
            del staged


def test_alternating_layouts_each_keep_their_plan() -> None:
    model, optim = _state(4), {"optim": {"m": torch.ones(64), "v": torch.zeros(64)}}
    with BudgetedStager(_budget(), options=CPU) as stager:
        for _ in range(3):
            for state in (model, optim):
                staged = _stage(stager, state)
                assert _same(staged, state)
                del staged
        assert stager.stats().plans_built == 2


def test_everything_that_is_not_a_pooled_tensor_is_copied_as_before() -> None:
    inner = OrderedDict(w=torch.ones(3))
    inner._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    shared_list = [1, 2]
    state: dict[str, Any] = {
        "model": inner,
        "empty": torch.empty(0, 4),
        "sparse": torch.eye(3).to_sparse(),
        "scalar": torch.tensor(2.5),
        "lists": [shared_list, shared_list, (torch.ones(2), "x")],
        "step": 1,
    }
    with BudgetedStager(_budget(), options=CPU) as stager:
        for _ in range(2):
            staged = _stage(stager, state)
            assert type(staged["model"]) is OrderedDict
            assert staged["model"]._metadata == inner._metadata  # type: ignore[attr-defined]
            assert staged["model"]._metadata is not inner._metadata  # type: ignore[attr-defined]
            assert torch.equal(staged["model"]["w"], inner["w"])
            assert staged["empty"].shape == (0, 4)
            assert torch.equal(staged["sparse"].to_dense(), torch.eye(3))
            assert staged["scalar"].item() == 2.5
            assert staged["lists"][0] is staged["lists"][1] and staged["lists"][0] == [1, 2]
            assert staged["lists"][0] is not shared_list
            assert torch.equal(staged["lists"][2][0], torch.ones(2))
            assert staged["lists"][2][1] == "x"
            del staged


def test_a_reused_view_kept_by_a_caller_is_never_overwritten() -> None:
    state = {"w": torch.ones(1024), "b": torch.ones(8)}
    with BudgetedStager(_budget(), options=CPU) as stager:
        staged = _stage(stager, state)
        del staged
        staged = _stage(stager, state)  # the cached views themselves
        kept = staged["w"]
        del staged
        state["w"].fill_(2.0)
        again = _stage(stager, state)
        assert torch.equal(kept, torch.ones(1024)) and torch.equal(again["w"], state["w"])
        assert stager.stats().allocations == 3  # only the kept buffer was allocated anew
        del again


def test_a_reused_view_read_through_another_view_is_never_overwritten() -> None:
    state = {"w": torch.ones(1024)}
    with BudgetedStager(_budget(), options=CPU) as stager:
        staged = _stage(stager, state)
        del staged
        staged = _stage(stager, state)
        window = staged["w"][:16]  # another tensor over the same buffer
        del staged
        state["w"].fill_(5.0)
        again = _stage(stager, state)
        assert torch.equal(window, torch.ones(16)) and torch.equal(again["w"], state["w"])
        del again


def test_the_guard_still_refuses_an_update_during_a_reused_plans_copy(tmp_path: Path) -> None:
    state = _state()
    with BudgetedStager(_budget(), options=CPU) as stager:
        for name in ("a", "b"):
            stager.async_save(
                state, storage_writer=FileSystemWriter(tmp_path / name), no_dist=True
            ).upload_completion.result()
        with hold_staging(stager):
            response = stager.async_save(
                state, storage_writer=FileSystemWriter(tmp_path / "c"), no_dist=True
            )
            state["model"]["layers.2.weight"].add_(1.0)
        with pytest.raises(SnapshotMutatedError) as raised:
            response.upload_completion.result()
        assert raised.value.fqns == ("model.layers.2.weight",)
        assert stager.stats().plan_reuses >= 2
        response = stager.async_save(
            state, storage_writer=FileSystemWriter(tmp_path / "d"), no_dist=True
        )
        response.upload_completion.result()
    loaded = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "d"), no_dist=True)
    assert _same(loaded, state)


@pytest.mark.parametrize("guard", [True, False], ids=["guard on", "guard off"])
def test_a_freed_source_storage_is_refused_before_its_chunk_is_copied(guard: bool) -> None:
    # Freeing a storage (as FSDP frees an unsharded parameter) moves no version counter: the
    # copy itself must refuse it, whether or not the guard is on, or it reads released memory.
    state = {"w": torch.ones(64), "v": torch.ones(64)}
    with BudgetedStager(
        _budget(), options=StagerOptions(pin_memory="off", mutation_guard=guard)
    ) as stager:
        staged = _stage(stager, state)
        del staged
        _settle(stager)
        with hold_staging(stager):
            future = stager.stage(state)
            state["v"].untyped_storage().resize_(0)
        with pytest.raises(SnapshotMutatedError) as raised:
            future.result()
        assert raised.value.fqns == ("v",)


def test_a_storage_swapped_between_saves_is_checked_and_staged_with_its_new_bytes() -> None:
    state = {"w": torch.ones(64), "v": torch.ones(64)}
    with BudgetedStager(_budget(), options=CPU) as stager:
        staged = _stage(stager, state)
        del staged
        state["v"].data = torch.full((64,), 7.0)  # a new storage, no version bump
        staged = _stage(stager, state)
        assert torch.equal(staged["v"], torch.full((64,), 7.0))
        assert torch.equal(staged["w"], state["w"])
        assert stager.stats().plan_reuses >= 1
        del staged


def test_a_storage_shrunk_under_its_tensor_does_not_hold_its_bytes() -> None:
    base = torch.arange(64.0)
    tail = base[32:]  # offset 32: needs the whole 256-byte storage
    assert holds_its_bytes(base) and holds_its_bytes(tail)
    assert holds_its_bytes(base.view(8, 8).t())  # strided: its last element is still element 63
    base.untyped_storage().resize_(200)  # 50 floats: the view's last 14 elements are gone
    assert not holds_its_bytes(tail)
    assert holds_its_bytes(torch.empty(0))
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)
    assert not holds_its_bytes(freed)


def test_the_layout_key_sees_shape_dtype_device_keys_and_aliases() -> None:
    a, b = torch.ones(4), torch.ones(4)
    base = scan({"x": a, "y": b}).key
    assert scan({"x": torch.zeros(4), "y": torch.zeros(4)}).key == base
    assert scan({"x": a, "y": a}).key != base
    assert scan({"x": a, "z": b}).key != base
    assert scan({"x": a, "y": b.double()}).key != base
    assert scan({"x": a, "y": b.view(2, 2)}).key != base
    assert scan({"x": a, "y": b.to(device="meta")}).key != base
    assert scan({"x": a, "y": [b]}).key != base


def test_a_pool_bundle_is_taken_whole_and_broken_for_another_layout() -> None:
    pool = BufferPool(pin_memory="off")
    request = pool.request([64, 32], token=7)
    with pool.condition:
        lease = pool.lease(request)
    lease.materialize()
    views = lease.typed_views(lambda bufs: [b.view(torch.float32) for b in bufs])
    lease.release(writer_done=False)
    with pool.condition:
        assert pool.plan(request) == (96, 0)
        again = pool.lease(request)
    assert again.views is views and again.materialize() == 0
    again.release(writer_done=True)
    with pool.condition:
        other = pool.lease(pool.request([64], token=8))
    other.materialize()
    assert other.allocated_bytes == 0  # the bundle was broken into the free lists
    other.release(writer_done=True)
    s = pool.stats()
    assert (s.allocated_bytes, s.free_bytes, s.in_use_bytes) == (96, 96, 0)
    pool.close()
    assert pool.stats().allocated_bytes == 0


def test_two_generations_of_one_layout_both_come_back_accounted() -> None:
    # With max_in_flight=2 two generations of one layout are leased at once; the second to come
    # back must not drop the first one's bundle while its bytes still count as free.
    pool = BufferPool(pin_memory="off")
    request = pool.request([64, 32], token=3)
    with pool.condition:
        first, second = pool.lease(request), pool.lease(request)
    for lease in (first, second):
        lease.materialize()
        lease.typed_views(lambda bufs: [b.view(torch.float32) for b in bufs])
    first.release(writer_done=True)
    second.release(writer_done=True)
    assert pool.stats().free_bytes == 192
    assert pool.trim(0) == 192
    assert pool.stats().allocated_bytes == 0


def test_a_view_held_from_cpp_keeps_the_bundle_apart() -> None:
    pool = BufferPool(pin_memory="off")
    request = pool.request([64], token=1)
    with pool.condition:
        lease = pool.lease(request)
    lease.materialize()
    view = lease.typed_views(lambda bufs: [b.view(torch.float32) for b in bufs])[0]
    holder: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    holder.set_result(view)  # held by the C++ future, not by a Python reference
    del view
    lease.release(writer_done=False)
    assert pool.stats().pending_bytes == 64
    del holder
    gc.collect()
    time.sleep(0)
    assert pool.stats().pending_bytes == 0
