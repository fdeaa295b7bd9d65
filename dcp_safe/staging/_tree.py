"""Finding the tensors of a state dict (one walk: :func:`scan`) and rebuilding it around their
staged copies.

Tensors are found in the containers DCP's planner flattens (mappings, lists, tuples). The rest
is ``copy.deepcopy``'d with a memo pre-seeded with the staged tensors, which substitutes each
staged copy for its source and keeps aliasing, so later mutation cannot race serialization.
``rebuild`` walks plain containers itself, with deepcopy's memo and results but without its
per-object dispatch (a tenth of the time per entry).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dcp_safe.torch_compat import dtensor_local, rebuild_dtensor

# Values deepcopy returns as they are; the walks skip them without a call.
_ATOMIC = frozenset({int, float, bool, complex, str, bytes, type(None)})
_MISSING = object()
# C getters mapped over the candidates: a fraction of a microsecond per tensor each.
_shape = torch.Tensor.shape.__get__  # type: ignore[attr-defined]
_dtype = torch.Tensor.dtype.__get__  # type: ignore[attr-defined]
_device = torch.Tensor.device.__get__  # type: ignore[attr-defined]
_layout = torch.Tensor.layout.__get__  # type: ignore[attr-defined]
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter


def is_stateful(value: object) -> bool:
    # Whether DCP treats ``value`` as ``Stateful`` (a model, an optimizer): duck typed, since
    # ``isinstance`` on the runtime protocol costs ~25 us a value.
    return (
        not isinstance(value, torch.Tensor | Mapping)
        and hasattr(value, "state_dict")
        and hasattr(value, "load_state_dict")
    )


def state_dicts_of(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each top-level ``Stateful`` replaced by its ``state_dict()``, as
    ``dcp.save``/``async_save`` do before they stage or plan."""
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state_dict.items()}


def stageable(value: object) -> bool:
    # A tensor the pool can hold: dense, strided, not a subclass.
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_quantized
        and value.device.type != "meta"
    )


def collect_tensors(obj: object) -> list[torch.Tensor]:
    """The distinct stageable tensors of ``obj`` (DTensors contribute their local shard), in
    walk order, so two walks of the same state give the same list."""
    return list({id(t): t for t in scan(obj).candidates if stageable(t)}.values())


@dataclass(eq=False)
class Layout:
    """One walk of a state dict: its candidate tensors, in walk order, and its layout key,
    computed on first use: the walk alone is what ``stage()`` pays on the training thread while
    the state's structure is unchanged (:meth:`~dcp_safe.staging.plan.PlanCache.speculate`)."""

    candidates: list[torch.Tensor]
    structure: tuple[Any, ...]

    @cached_property
    def key(self) -> tuple[Any, ...]:
        """The full layout key (docs/staging.md, "Thousands of tensors"); about 2 us a tensor."""
        candidates = self.candidates
        ids = list(map(id, candidates))
        aliases = None
        if len(set(ids)) != len(ids):  # a tensor reached twice: which entries share is layout
            first: dict[int, int] = {}
            aliases = tuple(first.setdefault(i, n) for n, i in enumerate(ids))
        getters = (_shape, _dtype, _device, _layout)
        return (self.structure, *(tuple(map(g, candidates)) for g in getters), aliases)


def scan(state: object) -> Layout:
    # One walk: the tensors DCP's planner would see, and the containers.
    candidates: list[torch.Tensor] = []
    structure: list[Any] = []
    _visit(state, candidates, structure)
    return Layout(candidates, tuple(structure))


def _visit(obj: object, candidates: list[torch.Tensor], structure: list[Any]) -> None:
    kind = type(obj)
    if kind is _TENSOR or kind is _PARAMETER:
        candidates.append(obj)  # type: ignore[arg-type]
        return
    if isinstance(obj, DTensor):
        local = dtensor_local(obj)
        if type(local) is _TENSOR or type(local) is _PARAMETER:
            candidates.append(local)
        return
    if isinstance(obj, Mapping):
        structure.append((kind, tuple(obj)))
        values: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        structure.append((kind, len(obj)))
        values = obj
    else:
        return  # a leaf DCP pickles whole; it is deep-copied, not staged
    append = candidates.append
    for value in values:
        kind = type(value)
        if kind is _TENSOR or kind is _PARAMETER:
            append(value)
        elif kind not in _ATOMIC:
            _visit(value, candidates, structure)


def rebuild(obj: Any, memo: dict[int, Any]) -> Any:
    """Deep-copy ``obj`` with each source tensor (by ``id``) replaced by its staged copy in
    ``memo`` (every key the ``id`` of a tensor in ``obj`` that the caller keeps alive, so the ids
    stay valid); ``memo`` becomes the copy's deepcopy memo."""
    kind = type(obj)
    if kind in _ATOMIC:
        return obj
    found = memo.get(id(obj), _MISSING)
    if found is not _MISSING:
        return found
    if kind is dict or kind is OrderedDict:
        out: dict[Any, Any] = kind()
        memo[id(obj)] = out
        if state := getattr(obj, "__dict__", None):  # an OrderedDict's (state_dict()'s _metadata)
            out.__dict__.update(rebuild(state, memo))
        for key, value in obj.items():
            if type(value) not in _ATOMIC:
                value = rebuild(value, memo)
            out[key if type(key) in _ATOMIC else rebuild(key, memo)] = value
        return out
    if kind is list:
        items: list[Any] = []
        memo[id(obj)] = items
        items.extend(v if type(v) in _ATOMIC else rebuild(v, memo) for v in obj)
        return items
    if kind is tuple:
        copied = tuple(v if type(v) in _ATOMIC else rebuild(v, memo) for v in obj)
        same = all(a is b for a, b in zip(obj, copied, strict=True))
        memo[id(obj)] = result = obj if same else copied
        return result
    if isinstance(obj, DTensor):
        local = memo.get(id(dtensor_local(obj)), _MISSING)
        if local is not _MISSING:
            memo[id(obj)] = rebuilt = rebuild_dtensor(local, obj)
            return rebuilt
    return copy.deepcopy(obj, memo)
