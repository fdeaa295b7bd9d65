"""Adopting a stock DCP checkpoint that two gloo ranks wrote with plain ``dcp.save`` and torch's
own ``FileSystemWriter``: a row-sharded DTensor, Adam's state over DTensor parameters and a
``BytesIO`` train state. Adopted by copy from a local folder and in place on moto S3, both list,
verify deep and restore bit-exact on 1, 2 and 4 ranks (through ``SafeStorageReader``, and on 2
ranks through ``CheckpointManager.restore``).

Gradients are set by hand, not computed, so Adam's update is elementwise and its results are the
same bits on any sharding: what a restore returns is compared exactly with what the save held.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import gather_full
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dcp_safe
from dcp_safe import CheckpointManager, Root, SafeStorageReader, list_checkpoints, verify_checkpoint
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.s3, pytest.mark.timeout(600)]

NAME = "step_0007"


def _training_state(world_size: int, seed: int) -> dict[str, Any]:
    """A DTensor model after one Adam step, and a train state; the same bits on any world size."""
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(6, 10)
    with torch.no_grad():
        model.weight = nn.Parameter(
            distribute_tensor(torch.randn(10, 6, generator=gen), mesh, [Shard(0)])
        )
        model.bias = nn.Parameter(
            distribute_tensor(torch.randn(10, generator=gen), mesh, [Replicate()])
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for param in model.parameters():
        grad = torch.randn(param.shape, generator=gen)
        param.grad = distribute_tensor(grad, mesh, param.placements)
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "train": io.BytesIO(f"epoch=3 seed={seed}".encode()),
    }


def _full(state: dict[str, Any]) -> dict[str, Any]:
    return {
        **gather_full({k: v for k, v in state.items() if k != "train"}),
        "train": state["train"].getvalue(),
    }


def _save_stock(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    state = _training_state(world_size, seed=1)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    return _full(state)


def _restore(rank: int, world_size: int, roots: list[Root]) -> list[dict[str, Any]]:
    found = []
    for n, root in enumerate(roots):
        target = _training_state(world_size, seed=2)  # the same structure, other values
        if world_size == 2 and n == 0:
            with CheckpointManager(root) as manager:
                assert manager.restore(target) == NAME
        else:
            dcp.load(target, checkpoint_id=NAME, storage_reader=SafeStorageReader(root))
        found.append(_full(target))
    return found


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key, value in expected.items():
            _assert_same(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for n, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{n}]")
    else:
        assert actual == expected, where


def test_a_two_rank_stock_checkpoint_adopted_locally_and_on_s3_restores_on_1_2_and_4_ranks(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    stock = tmp_path / "stock" / NAME
    saved = run_ranks(_save_stock, 2, args=(str(stock),), timeout_s=240)
    expected = saved[0]
    assert isinstance(expected["model"]["weight"], torch.Tensor) and expected["optim"]["state"]
    assert sorted(p.name for p in stock.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    local = Root(str(tmp_path / "root"))
    report = dcp_safe.adopt(stock, local.url)
    assert (report.name, report.copied, report.world_size) == (NAME, True, 2)
    assert report.unchecked and "no checksums" in report.unchecked[0]

    fs = fsspec.filesystem("s3", **s3_options)
    fs.put(str(stock), f"{s3_root.removeprefix('s3://')}/{NAME}", recursive=True)
    remote = Root(s3_root, s3_options)
    in_place = dcp_safe.adopt(Root(f"{s3_root}/{NAME}", s3_options), remote, copy=False)
    assert (in_place.copied, in_place.world_size, in_place.items) == (False, 2, report.items)

    for root in (local, remote):
        [info] = list_checkpoints(root)
        assert (info.name, info.world_size) == (NAME, 2)
        checked = verify_checkpoint(root, "latest", deep=True)
        assert checked.items_checked == report.items and checked.objects_checked >= 1

    for world_size in (1, 2, 4):
        restored = run_ranks(_restore, world_size, args=([local, remote],), timeout_s=240)
        for rank, per_root in enumerate(restored):
            for where, state in zip(("local", "s3"), per_root, strict=True):
                _assert_same(state, expected, f"{world_size} ranks, rank {rank}, {where}")
