"""The mutation guard: a staged copy is the state at the request, or the save fails.

:class:`SnapshotGuard` reads the sources' version counters at the request and again after the
copy; a difference means the copy may mix before and after (the generation is *torn*). What the
counters cannot see, what the guard costs and how a torn save fails on every rank:
docs/staging.md, "A snapshot of one moment". CUDA kernels enqueued before the request are
ordered before the copy by the stager's event, so they are in the snapshot, as intended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.staging._tree import collect_tensors, rebuild
from dcp_safe.torch_compat import dtensor_local, read_version


class SnapshotGuard:
    """The version counters of a save's source tensors, read at the request.

    ``sources`` are every candidate of the walk, a superset of what the plan picks, so the
    snapshot stays right when the plan is confirmed only later (kept alive: their ids stay valid).
    """

    __slots__ = ("_sources", "_versions")

    def __init__(self, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        # The only read on the training thread; the storage check is the copy's, later.
        self._versions = list(map(read_version, sources))

    def changed(self) -> list[torch.Tensor]:
        now = list(map(read_version, self._sources))
        if now == self._versions:  # the common case: one C-level list comparison
            return []
        pairs = zip(self._sources, self._versions, now, strict=True)
        return [t for t, before, after in pairs if before != after]


def tensor_paths(state_dict: object, tensors: Iterable[torch.Tensor]) -> list[str]:
    """The dotted paths in ``state_dict`` at which ``tensors`` appear (for error messages); a
    DTensor's shard by the DTensor's path, one the walk cannot find by its shape and dtype."""
    wanted = {id(t): t for t in tensors}
    found: dict[int, str] = {}
    _walk(state_dict, "", wanted, found)
    names = [found[i] for i in wanted if i in found]
    names += [f"<tensor {tuple(t.shape)} {t.dtype}>" for i, t in wanted.items() if i not in found]
    return names


def _walk(obj: object, path: str, wanted: dict[int, torch.Tensor], found: dict[int, str]) -> None:
    if isinstance(obj, DTensor):
        obj = dtensor_local(obj)
    if isinstance(obj, torch.Tensor) and id(obj) in wanted:
        found.setdefault(id(obj), path or "<root>")
    elif isinstance(obj, Mapping | list | tuple):
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for key, value in items:
            _walk(value, f"{path}.{key}" if path else str(key), wanted, found)


def snapshot_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A private copy of ``state_dict``, tensors copied to host memory outside any pool
    (SnapshotMutatedError when one changed in place while it was copied)."""
    guard = SnapshotGuard(sources := collect_tensors(state_dict))
    copies = {id(t): t.detach().to("cpu", copy=True) for t in sources}
    state: dict[str, Any] = rebuild(state_dict, copies)
    if changed := guard.changed():
        raise SnapshotMutatedError(tensor_paths(state_dict, changed))
    return state
