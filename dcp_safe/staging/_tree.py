"""Finding the tensors of a state dict and rebuilding it around their staged copies.

This module owns the state-dict walk. The tensors are found in the containers DCP's planner
flattens (mappings, lists, tuples), so the stager can size and admit a save before copying a
byte. The copy of everything else is ``copy.deepcopy`` with a memo pre-seeded with the staged
tensors: deepcopy then substitutes each staged tensor for its source wherever the source appears,
keeps aliasing (a tensor or object reached twice is copied once), and gives every non-tensor
value (nested dicts, lists, ints, user objects) its own copy, so later mutation cannot race
serialization. Tensors hidden inside other objects are deep-copied with those objects, outside
the pool; DCP's planner would pickle such objects whole anyway.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dcp_safe.torch_compat import dtensor_local, rebuild_dtensor

__all__ = ["collect_tensors", "rebuild", "stageable"]


def stageable(value: object) -> bool:
    """Whether ``value`` is a tensor the pool can hold: dense, strided, not a subclass."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_quantized
        and value.device.type != "meta"
    )


def collect_tensors(obj: object) -> list[torch.Tensor]:
    """The distinct stageable tensors of ``obj`` (DTensors contribute their local shard).

    Order is the walk order, so two walks of the same state give the same list.
    """
    found: dict[int, torch.Tensor] = {}
    _collect(obj, found)
    return list(found.values())


def _collect(obj: object, found: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, DTensor):
        local = dtensor_local(obj)
        if stageable(local):
            found.setdefault(id(local), local)
    elif stageable(obj):
        assert isinstance(obj, torch.Tensor)
        found.setdefault(id(obj), obj)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _collect(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, found)


def _seed_dtensors(obj: object, staged: dict[int, torch.Tensor], memo: dict[int, Any]) -> None:
    if isinstance(obj, DTensor):
        local = staged.get(id(dtensor_local(obj)))
        if local is not None and id(obj) not in memo:
            memo[id(obj)] = rebuild_dtensor(local, obj)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _seed_dtensors(value, staged, memo)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _seed_dtensors(value, staged, memo)


def rebuild(obj: Any, staged: dict[int, torch.Tensor]) -> Any:
    """Deep-copy ``obj`` with each source tensor (by ``id``) replaced by its staged copy.

    Args:
        obj: the live state dict; every key of ``staged`` must be the ``id`` of a live tensor
            in it (the caller keeps the sources alive, so the ids stay valid).
        staged: staged copy per source tensor ``id``.
    """
    memo: dict[int, Any] = dict(staged)
    _seed_dtensors(obj, staged, memo)
    return copy.deepcopy(obj, memo)
