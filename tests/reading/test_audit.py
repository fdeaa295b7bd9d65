"""A restore that proves itself: fingerprints over blocks of each tensor's global shape.

The fingerprint of a block is a sum, so the pieces of any sharding add up to the same value:
checked here on row, column and grid cuts of one tensor, then end to end on real gloo ranks,
saved by 4 and restored by 2 and by 1, with plain, sharded, replicated and per-rank tensors.
A load planner that swaps two tensors or drops a rank's shard is caught, naming key, block and
rank.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from support import resign_manifest
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcp_safe
from dcp_safe import SafeLoadPlanner, SafeStorageReader, SafeStorageWriter
from dcp_safe.errors import ConfigError, RestoreMismatchError
from dcp_safe.reading.audit import MAX_SAMPLES, Box, combine, mismatches, partials, report
from dcp_safe.testing.multiproc import run_ranks

_MASK = (1 << 64) - 1


def _summed(*parts: dict[int, int]) -> dict[int, int]:
    total: dict[int, int] = {}
    for part in parts:
        for block, value in part.items():
            total[block] = (total.get(block, 0) + value) & _MASK
    return total


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(96, 700),
        torch.randn(600, 300).to(torch.bfloat16),
        torch.randint(-5, 5, (90, 11), dtype=torch.int64),
        torch.rand(40, 33) > 0.5,
        torch.randn(30, 17, dtype=torch.complex128),
    ],
    ids=["float32", "bfloat16", "int64", "bool", "complex128"],
)
def test_the_pieces_of_any_cut_add_up_to_the_whole_tensors_fingerprint(
    tensor: torch.Tensor,
) -> None:
    shape = tuple(tensor.shape)
    whole = partials(Box((0, 0), shape, tensor))
    rows, cols = shape[0] * 2 // 5, shape[1] // 3
    by_rows = _summed(
        *(partials(Box((a, 0), shape, tensor[a:b])) for a, b in ((0, rows), (rows, shape[0])))
    )
    by_cols = _summed(
        *(partials(Box((0, a), shape, tensor[:, a:b])) for a, b in ((0, cols), (cols, shape[1])))
    )
    grid = _summed(
        *(
            partials(Box((a, c), shape, tensor[a:b, c:d]))
            for a, b in ((0, rows), (rows, shape[0]))
            for c, d in ((0, cols), (cols, shape[1]))
        )
    )
    assert whole == by_rows == by_cols == grid


def test_a_swapped_moved_or_missing_piece_changes_the_fingerprint() -> None:
    tensor = torch.randn(128, 64)
    whole = partials(Box((0, 0), (128, 64), tensor))
    swapped = tensor.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert partials(Box((0, 0), (128, 64), swapped)) != whole
    top = partials(Box((0, 0), (128, 64), tensor[:64]))
    assert top != whole  # the bottom half is missing
    moved = partials(Box((64, 0), (128, 64), tensor[:64]))  # the top half placed at the bottom
    assert _summed(top, moved) != whole
    big = torch.randn(MAX_SAMPLES * 3 + 5)  # sampled: every fourth element
    assert len(partials(Box((0,), tuple(big.shape), big))) == 16


def test_mismatches_name_the_key_the_block_and_the_rank_that_differs() -> None:
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    saved = combine([report({"a": a, "b": b}, 0)])
    assert mismatches(saved, [report({"a": a, "b": b}, r) for r in range(3)]) == []
    wrong = [report({"a": a, "b": b}, 0), report({"a": b, "b": b}, 1), report({"a": a, "b": b}, 2)]
    assert mismatches(saved, wrong) == [("a", 0, [1])]  # a plain tensor: rank 1's copy differs


# -- end to end ------------------------------------------------------------------------------


def _state(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(7)
    return {
        "rows": distribute_tensor(torch.randn(10, 6, generator=gen), mesh, [Shard(0)]),
        "cols": distribute_tensor(torch.randn(6, 9, generator=gen), mesh, [Shard(1)]),
        "bias": distribute_tensor(torch.randn(5, generator=gen), mesh, [Replicate()]),
        "step": torch.tensor(41),
        "a": torch.randn(4, 4, generator=gen),
        "b": torch.randn(4, 4, generator=gen),
    }


def _blank(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "rows": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
        "cols": distribute_tensor(torch.zeros(6, 9), mesh, [Shard(0)]),  # resharded on load
        "bias": distribute_tensor(torch.zeros(5), mesh, [Replicate()]),
        "step": torch.tensor(0),
        "a": torch.zeros(4, 4),
        "b": torch.zeros(4, 4),
    }


class _Swapping(SafeLoadPlanner):
    """A broken planner: what was saved under "a" lands in "b", and the other way round."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        swap = {"a": "b", "b": "a"}
        index = read_item.dest_index
        if index.fqn in swap:
            index = dataclasses.replace(index, fqn=swap[index.fqn])
            read_item = dataclasses.replace(read_item, dest_index=index)
        return super().resolve_tensor(read_item)


class _DroppingOnRank1(SafeLoadPlanner):
    """A broken planner: rank 1 never reads its shard of "rows" (left as it was)."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if torch.distributed.get_rank() != 1:
            return plan
        return dataclasses.replace(
            plan, items=[i for i in plan.items if i.dest_index.fqn != "rows"]
        )


def _save(rank: int, world_size: int, root: str) -> None:
    dcp_safe.save(
        _state(world_size), checkpoint_id="step_1", storage_writer=SafeStorageWriter(root)
    )


def _load(rank: int, world_size: int, root: str, planner: str) -> Any:
    kinds = {"good": SafeLoadPlanner, "swap": _Swapping, "drop": _DroppingOnRank1}
    target = _blank(world_size)
    plan = kinds[planner](name="step_1")
    try:
        dcp_safe.load(
            target,
            checkpoint_id="step_1",
            storage_reader=SafeStorageReader(root),
            planner=plan,
            audit=True,
        )
    except RestoreMismatchError as exc:
        return ("mismatch", exc.mismatches)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in target.items()}
    return ("ok", plan.report.audited, full)


@pytest.mark.multiproc
def test_an_audited_restore_passes_exact_and_resharded(tmp_path: Path) -> None:
    run_ranks(_save, 4, args=(str(tmp_path),))
    expected = _state_values()
    for world_size in (4, 2):
        results = run_ranks(_load, world_size, args=(str(tmp_path), "good"))
        for kind, audited, full in results:
            assert kind == "ok"
            assert set(audited) == {"rows", "cols", "bias", "step", "a", "b"}
            for key, value in expected.items():
                assert torch.equal(full[key], value), key


def _state_values() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    rows, cols, bias = (
        torch.randn(10, 6, generator=gen),
        torch.randn(6, 9, generator=gen),
        torch.randn(5, generator=gen),
    )
    return {
        "rows": rows,
        "cols": cols,
        "bias": bias,
        "step": torch.tensor(41),
        "a": torch.randn(4, 4, generator=gen),
        "b": torch.randn(4, 4, generator=gen),
    }


@pytest.mark.multiproc
def test_a_planner_that_swaps_tensors_or_drops_a_shard_is_caught(tmp_path: Path) -> None:
    run_ranks(_save, 4, args=(str(tmp_path),))
    swapped = run_ranks(_load, 2, args=(str(tmp_path), "swap"))
    assert swapped[0] == swapped[1]
    kind, found = swapped[0]
    assert kind == "mismatch" and {key for key, _, _ in found} == {"a", "b"}
    dropped = run_ranks(_load, 2, args=(str(tmp_path), "drop"))
    kind, found = dropped[0]
    assert kind == "mismatch" and dropped[1] == dropped[0]
    assert {key for key, _, _ in found} == {"rows"}
    assert all(1 in ranks for _, _, ranks in found)  # the rank whose shard is wrong,
    assert any(ranks == [1] for _, _, ranks in found)  # alone where a block is its alone


def test_an_audited_restore_in_one_process_and_a_checkpoint_without_fingerprints(
    tmp_path: Path,
) -> None:
    state = {"w": torch.arange(10.0), "meta": {"epoch": 3}}
    dcp_safe.save(state, checkpoint_id="s", storage_writer=SafeStorageWriter(tmp_path))
    target = {"w": torch.zeros(10), "meta": {"epoch": 0}}
    planner = SafeLoadPlanner()
    dcp_safe.load(
        target,
        checkpoint_id="s",
        storage_reader=SafeStorageReader(tmp_path),
        planner=planner,
        audit=True,
    )
    assert planner.report.audited == ("w",) and torch.equal(target["w"], state["w"])

    plain = dcp_safe.SafeSavePlanner(record_audit=False)
    dcp_safe.save(
        state, checkpoint_id="t", storage_writer=SafeStorageWriter(tmp_path), planner=plain
    )
    with pytest.raises(ConfigError, match="no fingerprints"):
        dcp_safe.load(
            target, checkpoint_id="t", storage_reader=SafeStorageReader(tmp_path), audit=True
        )


def test_a_dropped_column_shard_is_seen_whatever_the_row_length() -> None:
    # 4096 columns: a stride equal to the row's length would sample column 0 only.
    tensor = torch.randn(64, 4096)
    shape = tuple(tensor.shape)
    whole = partials(Box((0, 0), shape, tensor))
    left = partials(Box((0, 0), shape, tensor[:, :2048]))
    right_zeroed = partials(Box((0, 2048), shape, torch.zeros(64, 2048)))
    assert _summed(left, right_zeroed) != whole


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(8192),
        lambda: torch.randn(33, 7).to(torch.bfloat16),
        lambda: torch.randint(-(1 << 62), 1 << 62, (1000,), dtype=torch.int64),
        lambda: torch.randint(0, 255, (5, 3), dtype=torch.uint8),
        lambda: torch.randint(-9, 9, (300,), dtype=torch.int16),
        lambda: torch.rand(40, 33) > 0.5,
        lambda: torch.randn(30, 17, dtype=torch.complex128),
        lambda: torch.randn(3000, 5, dtype=torch.float64),
    ],
    ids=["float32", "bfloat16", "int64", "uint8", "int16", "bool", "complex128", "float64"],
)
def test_a_report_of_many_tensors_gives_each_the_sums_of_its_own_partials(make: Any) -> None:
    state = {f"t{i}": make() for i in range(5)}
    reported = report(state, 3)
    for key, tensor in state.items():
        shape = tuple(tensor.shape)
        assert reported[key] == [
            (3, (0,) * len(shape), shape, shape, partials(Box((0,) * len(shape), shape, tensor)))
        ]


def test_tensors_without_fingerprints_are_named_not_passed_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``v``'s fingerprints cut from the metadata (re-signed as a root writer can): the audit
    lists it as unchecked and warns, where it used to pass it as if audited."""
    state = {"w": torch.arange(10.0), "v": torch.ones(4)}
    dcp_safe.save(state, checkpoint_id="s", storage_writer=SafeStorageWriter(tmp_path))

    def edit(raw: dict[str, Any]) -> None:
        planner = raw["dcp_metadata"]["planner_data"]
        planner["audit"] = [pair for pair in planner["audit"] if pair[0] != "v"]

    resign_manifest(tmp_path, "s", edit)
    planner = SafeLoadPlanner()
    target = {"w": torch.zeros(10), "v": torch.zeros(4)}
    reader = SafeStorageReader(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dcp_safe"):
        dcp_safe.load(target, checkpoint_id="s", storage_reader=reader, planner=planner, audit=True)
    assert (planner.report.audited, planner.report.unaudited) == (("w",), ("v",))
    assert any(
        "were not checked" in r.getMessage() and "v" in r.getMessage() for r in caplog.records
    )
