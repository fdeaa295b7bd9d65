"""DTensor-sharded model and optimizer state saved on 2 and 4 gloo ranks, loaded on the other.

The model's parameters are DTensors laid out with ``distribute_tensor`` on a CPU DeviceMesh (one
weight split by rows, one by columns, a bias replicated); Adam's moments follow them. State goes
through ``get_state_dict``/``set_state_dict``. Checked: 2 -> 4 and 4 -> 2 give exactly the full
tensors the savers held (gathered with ``full_tensor()``), every rank of a 4-rank save wrote its
own shards, and one undistributed process loads the 4-rank checkpoint whole (4 -> 1).

Three ``run_ranks`` launches in all (2 ranks save; 4 ranks load, step, save; 2 ranks load), each
doing several checks.
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
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

import dcp_safe
from dcp_safe import SafeStorageWriter, layout, verify_checkpoint
from dcp_safe.manifest.schema import Manifest
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

# 12 rows / 8 columns divide by 2 and 4; 6 rows over 4 ranks is uneven (2, 2, 2, 0).
SHAPES = {"up.weight": (12, 8), "up.bias": (12,), "down.weight": (6, 12), "down.bias": (6,)}
PLACEMENTS: dict[str, list[Placement]] = {
    "up.weight": [Shard(0)],
    "up.bias": [Shard(0)],
    "down.weight": [Shard(1)],
    "down.bias": [Replicate()],
}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 6)


def _sharded_net(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The net with DTensor parameters on a ``world_size`` mesh, and Adam over them."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(seed)
    net = _Net()
    for fqn, placements in PLACEMENTS.items():
        module_name, param_name = fqn.split(".")
        module = net.get_submodule(module_name)
        full = getattr(module, param_name).detach()
        sharded = nn.Parameter(distribute_tensor(full, mesh, placements))
        module.register_parameter(param_name, sharded)
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One Adam step with seeded gradients (the same full gradient however it is sharded)."""
    gen = torch.Generator().manual_seed(seed)
    for fqn, param in net.named_parameters():
        grad = torch.randn(SHAPES[fqn], generator=gen)
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
    optimizer.step()
    optimizer.zero_grad()


# --------------------------------------------------------------- rank functions (module level)


def _save_after_steps(rank: int, world_size: int, root: str, name: str) -> dict[str, Any]:
    net, optimizer = _sharded_net(world_size, seed=0)
    for seed in (1, 2):
        _step(net, optimizer, seed)
    state = app_state(net, optimizer)
    dcp_safe.save(state, checkpoint_id=name, storage_writer=SafeStorageWriter(root))
    return gather_full(state)


def _load_step_save(rank: int, world_size: int, root: str, src: str, dst: str) -> dict[str, Any]:
    net, optimizer = _sharded_net(world_size, seed=5)  # other values: the load must replace them
    restore(net, optimizer, root, src)
    loaded = gather_full(app_state(net, optimizer))
    local = {fqn: tuple(p.to_local().shape) for fqn, p in net.named_parameters()}
    _step(net, optimizer, seed=3)
    state = app_state(net, optimizer)
    dcp_safe.save(state, checkpoint_id=dst, storage_writer=SafeStorageWriter(root))
    return {"loaded": loaded, "local_shapes": local, "saved": gather_full(state)}


def _load_only(rank: int, world_size: int, root: str, name: str) -> dict[str, Any]:
    net, optimizer = _sharded_net(world_size, seed=6)
    restore(net, optimizer, root, name)
    return gather_full(app_state(net, optimizer))


# --------------------------------------------------------------- tests


def test_dtensor_model_and_adam_state_reshard_from_two_ranks_to_four_and_back(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    two = run_ranks(_save_after_steps, 2, args=(root, "saved_by_2"))
    assert_state_equal(two[1], two[0])
    expected_2 = two[0]

    four = run_ranks(_load_step_save, 4, args=(root, "saved_by_2", "saved_by_4"))

    for rank, seen in enumerate(four):
        assert_state_equal(seen["loaded"], expected_2, f"2->4 rank {rank}")
        assert seen["local_shapes"] == {
            "up.weight": (3, 8),
            "up.bias": (3,),
            "down.weight": (6, 3),
            "down.bias": (6,),
        }
        assert_state_equal(seen["saved"], four[0]["saved"], f"rank {rank} disagrees")
    expected_4 = four[0]["saved"]
    assert expected_4["optim"]["state"]["up.weight"]["step"] == 3
    assert not torch.equal(expected_4["model"]["up.weight"], expected_2["model"]["up.weight"])

    back = run_ranks(_load_only, 2, args=(root, "saved_by_4"))

    for rank, seen in enumerate(back):
        assert_state_equal(seen, expected_4, f"4->2 rank {rank}")
    raw = (tmp_path / "saved_by_4" / layout.MANIFEST).read_bytes()
    manifest = Manifest.from_json(raw, "saved_by_4")
    assert manifest.world_size == 4
    # Every rank of the 4-rank save wrote its own rows of up.weight (DCP's shard files).
    writers = {item.offset: item.file for item in manifest.items if item.fqn == "model.up.weight"}
    assert writers == {(3 * r, 0): layout.shard_file_name(r, 0) for r in range(4)}
    verify_checkpoint(tmp_path, "saved_by_4")
    # 4 -> 1: an undistributed process with plain tensors gets the same full state.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    net = _Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    restore(net, optimizer, root, "saved_by_4")
    assert_state_equal(gather_full(app_state(net, optimizer)), expected_4, "4->1")
