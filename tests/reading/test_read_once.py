"""Restores read each entry once: what several ranks load identically is read by one of them.

Real gloo ranks save with ``dcp_safe.save`` and load with ``dcp_safe.load``; each rank reports
what it loaded and how many stored bytes its reader read, and the parent compares the sum over
ranks with the checkpoint's item bytes: about 1x with ``read_once`` (the default), world size
times without it, in the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, blank_tree, flip_item_byte
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    SafeLoadPlanner,
    SafeStorageReader,
    SafeStorageWriter,
    layout,
)
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.reading.read_once import ReadOncePlan, items_digest, share_reads
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def _values(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _replicated_state(seed: int = 0) -> dict[str, Any]:
    """The same on every rank: plain tensors of several dtypes and sizes, and objects."""
    return {
        "model.big": _values(seed + 1, 512, 256),  # 512 KiB
        "model.small": _values(seed + 2, 7),
        "model.half": _values(seed + 3, 33, 5).to(torch.bfloat16),
        "model.steps": torch.arange(10, dtype=torch.int64) + seed,
        "model.flag": torch.tensor(True),
        "config": {"epochs": 3, "seed": seed, "name": "replicated"},
        "history": [seed, 1.5, "x"],
    }


def _mesh(world_size: int) -> DeviceMesh:
    return DeviceMesh("cpu", list(range(world_size)))


def _with_dtensor(state: dict[str, Any], world_size: int, seed: int) -> dict[str, Any]:
    state["model.dtensor"] = distribute_tensor(
        _values(seed + 4, 64, 8), _mesh(world_size), [Replicate()]
    )
    return state


def _item_bytes(root: Path, name: str) -> int:
    path = root / name / layout.MANIFEST
    return sum(item.length for item in Manifest.from_json(path.read_bytes(), str(path)).items)


def _load(root: str, name: str, like: dict[str, Any], **planner: Any) -> tuple[Any, int, int]:
    target = blank_tree(like)
    reader = SafeStorageReader(root)
    plan = SafeLoadPlanner(**planner)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader, planner=plan)
    return target, reader.bytes_read, plan.bytes_received


def _local(state: dict[str, Any]) -> dict[str, Any]:
    """What the parent can compare: DTensors as their local tensor."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


# --------------------------------------------------------------- rank functions (module level)


def _replicated_on_and_off(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _with_dtensor(_replicated_state(), world_size, seed=0)
    dcp_safe.save(state, checkpoint_id="replicated", storage_writer=SafeStorageWriter(root))
    off, off_read, off_received = _load(root, "replicated", state, read_once=False)
    on, on_read, on_received = _load(root, "replicated", state)
    return {
        "off": _local(off),
        "on": _local(on),
        "on_is_dtensor": isinstance(on["model.dtensor"], DTensor),
        "off_read": off_read,
        "on_read": on_read,
        "off_received": off_received,
        "on_received": on_received,
    }


def _sharded(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = _mesh(world_size)
    full = _values(7, 16, 6)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "bias": _values(8, 6)}
    dcp_safe.save(state, checkpoint_id="sharded", storage_writer=SafeStorageWriter(root))
    same = {"w": distribute_tensor(torch.zeros(16, 6), mesh, [Shard(0)]), "bias": torch.zeros(6)}
    reader = SafeStorageReader(root)
    dcp_safe.load(same, checkpoint_id="sharded", storage_reader=reader)
    resharded = {"w": distribute_tensor(torch.zeros(16, 6), mesh, [Shard(1)])}
    dcp_safe.load(resharded, checkpoint_id="sharded", storage_reader=SafeStorageReader(root))
    return {
        "same_local": same["w"].to_local(),
        "expected_local": state["w"].to_local(),
        "bias": same["bias"],
        "resharded_full": resharded["w"].full_tensor(),
        "full": full,
        "read": reader.bytes_read,
    }


def _per_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = {"shared": _values(1, 100), "rank_state": {"rank": rank, "t": _values(10 + rank, 9)}}
    dcp_safe.save(
        state,
        checkpoint_id="per_rank",
        storage_writer=SafeStorageWriter(root),
        per_rank=("rank_state",),
    )
    target, read, _ = _load(root, "per_rank", state, per_rank=("rank_state",))
    return {"loaded": target, "saved": state, "read": read}


def _load_after_flip(rank: int, world_size: int, root: str) -> str:
    state = _replicated_state()
    dcp_safe.save(state, checkpoint_id="flipped", storage_writer=SafeStorageWriter(root))
    torch.distributed.barrier()
    if rank == 0:
        flip_item_byte(root, "flipped", "model.big")
    torch.distributed.barrier()
    try:
        _load(root, "flipped", state)
    except CheckpointCorruptError as exc:
        return f"CheckpointCorruptError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


class _Holder:
    """A ``Stateful`` entry: DCP loads into its ``state_dict()`` and hands the result back."""

    def __init__(self, weight: torch.Tensor, note: object) -> None:
        self.weight, self.note = weight, note

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "note": self.note}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight = state["weight"].clone()  # a copy: what arrives later would be lost
        self.note = state["note"]


def _stateful(rank: int, world_size: int, root: str) -> tuple[torch.Tensor, object, int]:
    saved = {"holder": _Holder(_values(5, 300), {"lr": 0.1}), "tail": ["a", rank >= 0]}
    dcp_safe.save(saved, checkpoint_id="stateful", storage_writer=SafeStorageWriter(root))
    target = {"holder": _Holder(torch.zeros(300), {"lr": -1.0}), "tail": ["", False]}
    planner = SafeLoadPlanner()
    dcp_safe.load(
        target, checkpoint_id="stateful", storage_reader=SafeStorageReader(root), planner=planner
    )
    assert target["tail"] == ["a", True]
    return target["holder"].weight, target["holder"].note, planner.bytes_received


def _plan_outside_dcp_safe_load(rank: int, world_size: int) -> str:
    try:
        SafeLoadPlanner(read_once=True).set_up_planner({"x": torch.zeros(1)}, None)
    except ConfigError as exc:
        return f"ConfigError: {exc}"
    return "planned"


# --------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicated_state_is_read_once_and_sent_exactly(tmp_path: Path, world_size: int) -> None:
    results = run_ranks(_replicated_on_and_off, world_size, args=(str(tmp_path),))
    expected = _local(_with_dtensor_values(_replicated_state()))
    for seen in results:
        assert_state_equal(seen["off"], expected)
        assert_state_equal(seen["on"], expected)
        assert seen["on_is_dtensor"]
    checkpoint = _item_bytes(tmp_path, "replicated")
    assert sum(r["off_read"] for r in results) == world_size * checkpoint
    assert sum(r["on_read"] for r in results) == checkpoint
    # Every rank read something: the entries are spread, not all read by rank 0.
    assert all(r["on_read"] > 0 for r in results)
    assert all(r["off_received"] == 0 for r in results)
    assert sum(r["on_received"] for r in results) > (world_size - 1) * 512 * 256 * 4


def _with_dtensor_values(state: dict[str, Any]) -> dict[str, Any]:
    state["model.dtensor"] = _values(4, 64, 8)
    return state


def test_sharded_dtensor_still_reads_its_own_shards(tmp_path: Path) -> None:
    results = run_ranks(_sharded, 2, args=(str(tmp_path),))
    for seen in results:
        assert torch.equal(seen["same_local"], seen["expected_local"])
        assert torch.equal(seen["bias"], _values(8, 6))
        assert torch.equal(seen["resharded_full"], seen["full"])
    # Each rank its own shard; the replicated bias once, by one of them.
    assert sum(r["read"] for r in results) == _item_bytes(tmp_path, "sharded")


def test_per_rank_keys_restore_to_their_own_rank(tmp_path: Path) -> None:
    results = run_ranks(_per_rank, 2, args=(str(tmp_path),))
    for seen in results:
        assert_state_equal(seen["loaded"], seen["saved"])
    assert results[0]["loaded"]["rank_state"]["rank"] == 0
    assert results[1]["loaded"]["rank_state"]["rank"] == 1
    assert sum(r["read"] for r in results) == _item_bytes(tmp_path, "per_rank")


def test_an_owner_that_reads_a_corrupt_entry_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_ranks(_load_after_flip, 2, args=(str(tmp_path),))
    for outcome in outcomes:
        assert outcome.startswith("CheckpointCorruptError"), outcome
        assert "model.big" in outcome


def test_stateful_entries_get_what_other_ranks_read_before_they_load_it(tmp_path: Path) -> None:
    results = run_ranks(_stateful, 2, args=(str(tmp_path),))
    for weight, note, _ in results:
        assert torch.equal(weight, _values(5, 300))
        assert note == {"lr": 0.1}
    assert sum(received for _, _, received in results) > 0


def test_read_once_true_outside_dcp_safe_load_is_refused() -> None:
    """Only ``dcp_safe.load`` sends the entries after DCP's load: with ``dcp.load`` the other
    ranks would be left without them."""
    for outcome in run_ranks(_plan_outside_dcp_safe_load, 2):
        assert outcome.startswith("ConfigError: read_once=True needs dcp_safe.load"), outcome


def _read(fqn: str, numel: int) -> ReadItem:
    index = MetadataIndex(fqn, (0,))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size([0]),
        storage_index=index,
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([numel]),
    )


def test_each_shared_entry_is_read_by_one_holder_and_sent_to_the_others_only() -> None:
    """HSDP-like: shard ``a*`` replicated on ranks 0 and 2, ``b*`` on 1 and 3, ``c*`` on all;
    ``own3`` is rank 3's alone, and ``x`` differs in dtype between ranks (not shared)."""
    holders = {
        **{f"a{i}": (0, 2) for i in range(4)},
        **{f"b{i}": (1, 3) for i in range(4)},
        **{f"c{i}": (0, 1, 2, 3) for i in range(8)},
        "own3": (3,),
        "x": (0, 1, 2, 3),
    }
    sizes = {key: 100 * (i + 1) for i, key in enumerate(holders)}
    plans = []
    for rank in range(4):
        keys = [k for k, ranks in holders.items() if rank in ranks]
        items = [_read(k, sizes[k]) for k in keys]
        plans.append(
            ReadOncePlan(
                items=items,
                items_digest=items_digest(items),
                dtypes=[
                    "torch.float64" if k == "x" and rank == 1 else "torch.float32" for k in keys
                ],
            )
        )
    result = share_reads(plans, lambda item: 4 * item.lengths[0])
    readers: dict[str, list[int]] = {}
    for rank, plan in enumerate(result):
        for item in plan.items:
            readers.setdefault(item.dest_index.fqn, []).append(rank)
    # ``x`` as float64 (rank 1) is another entry than ``x`` as float32 (ranks 0, 2, 3).
    shared = {**holders, "x": (0, 2, 3)}
    assert 1 in readers["x"]
    readers["x"].remove(1)
    for key, ranks in shared.items():
        assert len(readers[key]) == 1 and readers[key][0] in ranks, key
    for rank, plan in enumerate(result):
        assert isinstance(plan, ReadOncePlan)
        for transfer in plan.transfers:
            assert rank == transfer.owner or rank in transfer.dests
            for item in transfer.items:
                key = item.dest_index.fqn
                assert readers[key] == [transfer.owner]
                assert set(transfer.dests) == set(shared[key]) - {transfer.owner}
    read = [sum(4 * i.lengths[0] for i in plan.items) for plan in result]
    assert max(read) - min(read) <= 4 * max(sizes.values())


def test_one_rank_or_another_planner_plans_as_before() -> None:
    alone = [ReadOncePlan(items=[_read("w", 4)], dtypes=["torch.float32"])]
    assert share_reads(alone, lambda item: 16) == alone


def test_plans_a_subclass_edited_after_they_were_described_are_left_alone() -> None:
    """A planner subclass that drops an item from the plan dcp_safe described: nothing is
    shared, every rank reads what its plan says."""
    items = [_read("a", 4), _read("b", 4)]
    described = ReadOncePlan(
        items=items, dtypes=["torch.float32"] * 2, items_digest=items_digest(items)
    )
    edited = ReadOncePlan(
        items=items[:1], dtypes=["torch.float32"] * 2, items_digest=described.items_digest
    )
    renamed = ReadOncePlan(
        items=[items[1], items[0]], dtypes=described.dtypes, items_digest=described.items_digest
    )
    for other in (edited, renamed):
        plans = [described, other]
        assert share_reads(plans, lambda item: 16) == plans
    assert len(share_reads([described, described], lambda item: 16)[1].items) == 1
