"""FSDP2 (``fully_shard``) model and Adam state through dcp_safe, resharded across world sizes.

The state goes through DCP's own ``get_state_dict``/``set_state_dict``, as a training script
does. One process saves an unsharded model and optimizer (world size 1); two gloo ranks load it
into an FSDP2-sharded model (1 -> 2), check the shards, train a step and save; the parent loads
that back into a plain model (2 -> 1). Every comparison is exact, against full tensors gathered
with ``full_tensor()`` on the ranks or taken from the unsharded reference.

One ``run_ranks`` launch does all of the two-rank work (one process group for all of it).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, gather_full
from support.training import app_state, restore
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dcp_safe
from dcp_safe import (
    SafeStorageWriter,
    layout,
    list_checkpoints,
    verify_checkpoint,
)
from dcp_safe.manifest.schema import Manifest
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

IN, HIDDEN, OUT = 6, 10, 3  # HIDDEN even, OUT odd: FSDP pads uneven dim-0 shards


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


# --------------------------------------------------------------- rank function (module level)


def _fsdp_load_train_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    model = _model(seed=99)  # other weights than the checkpoint: the load must replace them
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: dict[str, Any] = {}

    restore(model, optimizer, root, "one_rank")  # 1 -> 2
    loaded = app_state(model, optimizer)
    seen["sharded"] = all(isinstance(v, DTensor) for v in loaded["model"].values())
    seen["local_rows"] = {k: v.to_local().shape[0] for k, v in loaded["model"].items()}
    seen["loaded"] = gather_full(loaded)

    _train_step(model, optimizer, step=3)  # sharded training goes on from the loaded state
    saved = app_state(model, optimizer)
    dcp_safe.save(saved, checkpoint_id="two_ranks", storage_writer=SafeStorageWriter(root))
    seen["saved"] = gather_full(saved)
    seen["listed"] = [info.name for info in list_checkpoints(root)]
    return seen


# --------------------------------------------------------------- tests


def test_fsdp2_model_and_adam_state_reshard_from_one_rank_to_two_and_back(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = _model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        _train_step(model, optimizer, step)
    one_rank = gather_full(app_state(model, optimizer))
    dcp_safe.save(
        app_state(model, optimizer),
        checkpoint_id="one_rank",
        storage_writer=SafeStorageWriter(tmp_path),
    )

    per_rank = run_ranks(_fsdp_load_train_save, 2, args=(str(tmp_path),))

    for rank, seen in enumerate(per_rank):
        assert seen["sharded"], "fully_shard left a parameter unsharded"
        # Dim 0 split over two ranks: 10 rows as 5 + 5, 3 rows as 2 + 1.
        assert seen["local_rows"]["0.weight"] == HIDDEN // 2
        assert seen["local_rows"]["2.weight"] == [2, 1][rank]
        # Weights, Adam moments and step counts.
        assert_state_equal(seen["loaded"], one_rank, "1->2")
    assert_state_equal(per_rank[0]["saved"], per_rank[1]["saved"])  # gathered whole, ranks agree
    saved = per_rank[0]["saved"]
    assert saved["optim"]["state"]["0.weight"]["step"] == 4  # 3 steps before, 1 after the load
    assert not torch.equal(saved["model"]["0.weight"], one_rank["model"]["0.weight"])
    assert per_rank[0]["listed"] == ["one_rank", "two_ranks"]

    # 2 -> 1: an unsharded model in this process gets exactly what the two ranks held.
    fresh = _model(seed=7)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    restore(fresh, fresh_optimizer, str(tmp_path), "two_ranks")
    assert_state_equal(gather_full(app_state(fresh, fresh_optimizer)), saved, "2->1")
    raw = (tmp_path / "two_ranks" / layout.MANIFEST).read_bytes()
    assert Manifest.from_json(raw, "two_ranks").world_size == 2
    assert verify_checkpoint(tmp_path, "two_ranks").items_checked > 0
