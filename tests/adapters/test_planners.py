"""Each rank gets back exactly its own state: divergence refused, per-rank state declared.

DCP keeps one copy of every non-sharded entry several ranks save under one key. The probe a new
user would write (each rank's RNG state and data position under plain keys) must fail on every
rank with DivergentStateError before anything is published; declared ``per_rank`` it restores
each rank's own values; replicated state that really is equal saves as before.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, SavePlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcp_safe
from dcp_safe import SafeLoadPlanner, SafeStorageReader, SafeStorageWriter, list_checkpoints
from dcp_safe.adapters.planners import (
    FingerprintedPlan,
    RestoreReport,
    divergent_keys,
    fingerprint,
    fingerprints_of,
)
from dcp_safe.errors import DivergentStateError, MissingKeysError, PerRankStateError
from dcp_safe.reading.read_once import ReadOncePlan, items_digest
from dcp_safe.testing.multiproc import run_ranks

# -- the pure parts -------------------------------------------------------------------------


def _plan(rank: int, **fingerprints: int) -> FingerprintedPlan:
    return FingerprintedPlan(items=[], fingerprints=fingerprints, rank=rank)


def test_keys_whose_fingerprints_differ_are_named_with_the_ranks_grouped_by_value() -> None:
    plans = [_plan(0, rng=1, step=7), _plan(1, rng=2, step=7), _plan(2, rng=1, step=7)]
    assert divergent_keys(plans) == {"rng": [[0, 2], [1]]}
    assert divergent_keys([_plan(0, a=1), SavePlan(items=[])]) == {}  # another planner's plan


def test_fingerprints_see_values_not_identity() -> None:
    assert fingerprint({"a": torch.ones(3), "b": [1, "x"]}) == fingerprint(
        {"a": torch.ones(3), "b": [1, "x"]}
    )
    assert fingerprint(torch.ones(3)) != fingerprint(torch.ones(3, dtype=torch.float64))
    assert fingerprint(torch.zeros(2, 3)) != fingerprint(torch.zeros(3, 2))
    assert fingerprint({"pos": 100}) != fingerprint({"pos": 0})
    assert fingerprint(torch.arange(6.0)[::2]) == fingerprint(torch.tensor([0.0, 2.0, 4.0]))


def test_large_tensors_hashed_in_parallel_get_the_same_fingerprints_in_key_order() -> None:
    big = 2 << 20  # float32 elements: 8 MiB, past the parallel threshold
    values: dict[str, object] = {
        "small": torch.arange(10.0),
        "w0": torch.randn(big),
        "step": 7,
        "w1": torch.randn(big)[::2],  # strided: made contiguous first
        "w2": torch.randn(big, dtype=torch.float64),
    }
    found = fingerprints_of(values)
    assert list(found) == list(values)
    assert found == {key: fingerprint(value) for key, value in values.items()}


def test_shared_reads_spread_over_ranks_when_the_reader_keeps_no_stored_lengths() -> None:
    """A reader whose metadata has no stored lengths (DCP's Hugging Face one): each entry costs
    its region in the stored dtype, so two ranks holding the same two tensors read one each."""
    shape = torch.Size([8, 4])
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), shape)
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float16), shape, [chunk])
    planner = SafeLoadPlanner()
    planner.metadata = Metadata(
        state_dict_metadata={"a": tensor, "b": tensor},
        storage_data={MetadataIndex(k, [0, 0]): object() for k in ("a", "b")},
    )
    items = [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(key, [0, 0]),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex(key, [0, 0]),
            storage_offsets=torch.Size([0, 0]),
            lengths=shape,
        )
        for key in ("a", "b")
    ]
    local = ReadOncePlan(
        items=items, dtypes=["torch.float16"] * 2, items_digest=items_digest(items)
    )
    result = planner.create_global_plan([local, local])
    assert [len(plan.items) for plan in result] == [1, 1]


# -- the probe, on real ranks -----------------------------------------------------------------


def _sharded(value: torch.Tensor) -> Any:
    """A DTensor sharded by rows over every rank (FSDP2's layout), or the plain tensor alone."""
    if not torch.distributed.is_initialized():
        return value
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return distribute_tensor(value, mesh, [Shard(0)])


def _probe_state(rank: int) -> dict[str, Any]:
    """A model sharded over the ranks and one replicated on every rank (equal), and per-rank
    RNG and data position."""
    torch.manual_seed(1000 + rank)  # every real job's RNG differs per rank
    return {
        "model": {
            "w": torch.arange(12.0).reshape(3, 4),
            "emb": _sharded(torch.arange(32.0).reshape(8, 4)),
            "step": 5,
        },
        "rng": torch.get_rng_state(),
        "loader": {"pos": 100 * rank, "epoch": 2},
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(3, 4), "emb": _sharded(torch.zeros(8, 4)), "step": 0},
        "rng": torch.zeros_like(torch.get_rng_state()),
        "loader": {"pos": -1, "epoch": -1},
    }


def _probe(rank: int, world_size: int, root: str, per_rank: tuple[str, ...]) -> dict[str, Any]:
    saved = _probe_state(rank)
    try:
        dcp_safe.save(
            saved,
            checkpoint_id="step_1",
            storage_writer=SafeStorageWriter(root),
            per_rank=per_rank,
        )
    except DivergentStateError as exc:
        return {"refused": exc.keys}
    loaded = _blank()
    dcp_safe.load(
        loaded, checkpoint_id="step_1", storage_reader=SafeStorageReader(root), per_rank=per_rank
    )
    emb = loaded["model"]["emb"]
    return {
        "own_rng": torch.equal(loaded["rng"], saved["rng"]),
        "pos": loaded["loader"]["pos"],
        "model_equal": torch.equal(loaded["model"]["w"], saved["model"]["w"])
        and torch.equal(emb.full_tensor(), torch.arange(32.0).reshape(8, 4)),
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 4])
def test_per_rank_state_under_plain_keys_is_refused_on_every_rank(
    tmp_path: Path, world_size: int
) -> None:
    results = run_ranks(_probe, world_size, args=(str(tmp_path), ()))
    for result in results:
        refused = result["refused"]
        assert set(refused) == {"rng", "loader.pos"}  # the model and epoch are equal: fine
        assert sorted(r for group in refused["loader.pos"] for r in group) == list(
            range(world_size)
        )
    assert list_checkpoints(tmp_path) == []  # nothing published
    assert not any(tmp_path.glob("*/.metadata"))


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 4])
def test_declared_per_rank_every_rank_restores_its_own_values(
    tmp_path: Path, world_size: int
) -> None:
    results = run_ranks(_probe, world_size, args=(str(tmp_path), ("rng", "loader")))
    assert [r["own_rng"] for r in results] == [True] * world_size
    assert [r["pos"] for r in results] == [100 * r for r in range(world_size)]
    assert all(r["model_equal"] for r in results)


def _restore_on(rank: int, world_size: int, root: str, exclude: tuple[str, ...]) -> Any:
    loaded = _blank()
    reader = SafeStorageReader(root)
    try:
        dcp_safe.load(
            loaded,
            checkpoint_id="step_1",
            storage_reader=reader,
            planner=dcp_safe.SafeLoadPlanner(per_rank=("rng", "loader"), exclude=exclude),
        )
    except PerRankStateError as exc:
        return ("refused", exc.key, exc.saved_ranks, exc.world_size)
    return ("loaded", loaded["model"]["step"], loaded["loader"]["pos"])


@pytest.mark.multiproc
def test_per_rank_state_restores_only_onto_the_world_size_that_saved_it(tmp_path: Path) -> None:
    run_ranks(_probe, 2, args=(str(tmp_path), ("rng", "loader")))
    refused = run_ranks(_restore_on, 4, args=(str(tmp_path), ()))
    assert {r[0] for r in refused} == {"refused"}
    assert refused[0][2:] == ([0, 1], 4)
    # The documented way on: restore the rest (resharded 2 -> 4), per-rank state afresh.
    loaded = run_ranks(_restore_on, 4, args=(str(tmp_path), ("rng", "loader")))
    assert loaded == [("loaded", 5, -1)] * 4
    assert _restore_on(0, 1, str(tmp_path), ())[0] == "refused"  # one process: another size


# -- selective restore ------------------------------------------------------------------------


def test_a_selective_load_reports_what_it_restored_skipped_and_found_missing(
    tmp_path: Path,
) -> None:
    saved = {"model": {"w": torch.ones(4), "b": torch.full((2,), 3.0)}, "optim": {"lr": 0.1}}
    dcp_safe.save(saved, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))

    target = {"model": {"w": torch.zeros(4), "b": torch.zeros(2)}, "optim": {"lr": 0.0}}
    planner = dcp_safe.SafeLoadPlanner(exclude=["optim"], name="step_1")
    reader = SafeStorageReader(tmp_path)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader, planner=planner)
    assert torch.equal(target["model"]["w"], torch.ones(4)) and target["optim"]["lr"] == 0.0
    report = planner.report
    assert report.restored == ("model.b", "model.w") and report.skipped == ("optim.lr",)
    assert report.missing == () and report.unexpected == ()  # optim was skipped, not unasked

    asking_more = {"model": {"w": torch.zeros(4), "extra": torch.zeros(1)}}
    with pytest.raises(MissingKeysError, match=r"model\.extra"):
        dcp_safe.load(asking_more, checkpoint_id="step_1", storage_reader=reader)
    assert torch.equal(asking_more["model"]["w"], torch.zeros(4))  # nothing was loaded
    partial = dcp_safe.SafeLoadPlanner(allow_partial=True)
    dcp_safe.load(asking_more, checkpoint_id="step_1", storage_reader=reader, planner=partial)
    assert torch.equal(asking_more["model"]["w"], torch.ones(4))
    assert partial.report.missing == ("model.extra",)
    assert partial.report.unexpected == ("model.b", "optim.lr")


def test_a_restore_report_survives_pickling_and_copying_with_every_key_list() -> None:
    report = RestoreReport("step_1", restored=["b", "a"], missing=["m"], audited=["a"])
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(report, protocol=proto))
        assert type(again) is RestoreReport and again == "step_1" and again.name == "step_1"
        assert vars(again) == vars(report) and again.restored == ("a", "b")
    assert vars(copy.deepcopy(report)) == vars(report) == vars(copy.copy(report))
    assert report.audited == ("a",) and report.skipped == ()
    with pytest.raises(TypeError, match="restord"):
        RestoreReport("step_1", restord=["a"])


def test_a_planner_used_for_a_second_load_maps_per_rank_keys_afresh(tmp_path: Path) -> None:
    # The first checkpoint holds "rng" per rank, the second as one entry: the second load must
    # not look for the first one's per-rank name.
    root = str(tmp_path)
    state = {"w": torch.ones(2), "rng": torch.arange(3.0)}
    dcp_safe.save(
        state, checkpoint_id="a", storage_writer=SafeStorageWriter(root), per_rank=("rng",)
    )
    state["rng"] = torch.arange(3.0) + 1
    dcp_safe.save(state, checkpoint_id="b", storage_writer=SafeStorageWriter(root))
    planner = dcp_safe.SafeLoadPlanner(per_rank=("rng",))
    for name, expected in (("a", torch.arange(3.0)), ("b", torch.arange(3.0) + 1)):
        target = {"w": torch.zeros(2), "rng": torch.zeros(3)}
        dcp_safe.load(
            target, checkpoint_id=name, storage_reader=SafeStorageReader(root), planner=planner
        )
        assert torch.equal(target["rng"], expected), name
