"""State dicts for the tests: one with every dtype the foundation promises to round-trip, a
load target for it, exact comparisons, DTensor state sharded by rows and gathered whole, and the
union of what several ranks hold."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def make_state(seed: int = 0) -> dict[str, Any]:
    """Tensors of many dtypes and layouts, plus nested Python objects."""
    gen = torch.Generator().manual_seed(seed)
    square = torch.randn(6, 6, generator=gen)
    return {
        "f32": torch.randn(16, 8, generator=gen),
        "bf16": torch.randn(32, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(4, 4, generator=gen).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (50,), generator=gen),
        "bool": torch.randint(0, 2, (13,), generator=gen).bool(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(float(seed)),
        "transposed": square.t(),
        "sliced": torch.randn(10, 10, generator=gen)[2:5, 1:9],
        "extra": {"epoch": seed, "history": [1.5, {"lr": 0.1 * (seed + 1)}], "tag": f"s{seed}"},
    }


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target with the same structure and all tensors zeroed, objects scrambled."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value.contiguous())
        else:
            out[key] = copy.deepcopy(value)
    out["extra"]["epoch"] = -1
    out["extra"]["history"][1]["lr"] = -1.0
    return out


def assert_state_equal(actual: dict[str, Any], expected: dict[str, Any], where: str = "") -> None:
    """Exact equality of nested state: tensors by dtype and value, dicts key by key."""
    assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
    for key, value in expected.items():
        path = f"{where}.{key}" if where else str(key)
        if isinstance(value, torch.Tensor):
            assert isinstance(actual[key], torch.Tensor), path
            assert actual[key].dtype == value.dtype, path
            assert torch.equal(actual[key], value), path
        elif isinstance(value, dict):
            assert_state_equal(actual[key], value, path)
        else:
            assert actual[key] == value, path


def differing_tensors(actual: Any, expected: Any, where: str = "") -> list[str]:
    """The paths of the tensors in ``expected`` that ``actual`` does not hold exactly."""
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and torch.equal(actual, expected)
        return [] if same else [where or "<root>"]
    if isinstance(expected, dict):
        return [
            path
            for key, value in expected.items()
            for path in differing_tensors(
                actual.get(key) if isinstance(actual, dict) else None,
                value,
                f"{where}.{key}" if where else str(key),
            )
        ]
    return []


def gather_full(value: Any) -> Any:
    """A copy of ``value`` with every DTensor gathered whole (a collective on every rank)."""
    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: gather_full(item) for key, item in value.items()}
    if isinstance(value, list):
        return [gather_full(item) for item in value]
    return value


def rank_union(
    rank_state: Callable[[int, int], dict[str, Any]], world_size: int, seed: int = 0
) -> dict[str, Any]:
    """Everything ``world_size`` ranks hold together, each rank's part from ``rank_state``."""
    state: dict[str, Any] = {}
    for rank in range(world_size):
        state.update(rank_state(rank, seed))
    return state


def blank_tree(value: Any) -> Any:
    """A load target shaped like ``value``: tensors zeroed, every number in objects -1."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {key: blank_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [blank_tree(item) for item in value]
    return -1


def shard_rows(world_size: int, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each tensor of ``full`` as a DTensor sharded by rows (``Shard(0)``) over this process
    group's ``world_size`` ranks (call it inside an initialized group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return {key: distribute_tensor(value, mesh, [Shard(0)]) for key, value in full.items()}
