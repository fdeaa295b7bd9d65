"""The mutation guard: a staged copy is the state at the request, or the save fails.

This module owns the one question "did any source tensor change between the save request and
the end of its copy?", and how a "yes" travels to every rank.

How it is answered: every in-place update through autograd's view of a tensor (optimizer steps,
``no_grad`` ``add_``, writes through views, ``resize_``/``set_``) bumps the tensor's version
counter. :class:`SnapshotGuard` reads the counters of the sources when the save is requested (on
the caller's thread, before the call returns) and again once the copy has finished; any
difference means the copy may hold a mix of before and after, so the generation is *torn*.
Reading a counter costs about 0.1 µs (a C getter mapped over the list), which is why the
guard is on by default: docs/benchmarks.md measures it against the copy.

What it cannot see (docs/staging.md repeats this for users): writes through ``.data`` (a new
counter shares the storage), assignments to ``.data`` and storages freed and allocated again (a
new storage under the same counter), writes from another process or through raw pointers, CUDA
kernels already enqueued before the request but running after it (they are ordered before the
copy by the stager's event, so they are *in* the snapshot, as intended), BatchNorm's
running-statistic update in the forward pass (torch 2.13 does not bump the counter), and an
update that is still executing when the copy ends (its counter moves only when the kernel
returns). A storage freed and not allocated again is the copy's to refuse
(:mod:`dcp_safe.staging.generation`), guard or no guard. The manager's default staging mode
does not depend on the guard for its own thread: ``save()`` returns only after the copy.

How a torn generation fails the save: in a single process the staging future fails with
:class:`~dcp_safe.errors.SnapshotMutatedError`, so the upload never starts; under several ranks
the torn rank hands DCP a poisoned state dict instead (:mod:`dcp_safe.staging.poison`), so every
rank fails alike, inside DCP's collective, with the error naming the torn rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.staging._tree import collect_tensors, rebuild
from dcp_safe.torch_compat import dtensor_local, read_version

__all__ = [
    "SnapshotGuard",
    "current_rank",
    "snapshot_copy",
    "tensor_paths",
]


class SnapshotGuard:
    """The version counters of a save's source tensors, read at the request.

    Args:
        sources: the tensors the stager may copy, in walk order (the stager passes every
            candidate of the walk, a superset of the sources its plan picks, so the snapshot
            stays right when the plan is confirmed only later, on the staging thread). The
            guard keeps them alive until it is dropped, so their identities stay valid.
    """

    __slots__ = ("_sources", "_versions")

    def __init__(self, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        # The only read on the training thread: one C getter mapped over the list, mostly
        # cache misses on a large state (about 0.3 us a tensor cold). Whether a source's
        # storage still holds its bytes is the copy's check, on the staging thread
        # (:func:`dcp_safe.staging.generation.copy_sources`), not a snapshot taken here.
        self._versions = list(map(read_version, sources))

    def changed(self) -> list[torch.Tensor]:
        """The sources whose counter moved since the request (empty when none did)."""
        now = list(map(read_version, self._sources))
        if now == self._versions:  # the common case: one C-level list comparison
            return []
        pairs = zip(self._sources, self._versions, now, strict=True)
        return [t for t, before, after in pairs if before != after]


def tensor_paths(state_dict: object, tensors: Iterable[torch.Tensor]) -> list[str]:
    """The dotted paths in ``state_dict`` at which ``tensors`` appear (for error messages).

    A tensor reached through a DTensor is named by the DTensor's path. Tensors not found by the
    walk (hidden in other objects) are named by shape and dtype.
    """
    wanted = {id(t): t for t in tensors}
    found: dict[int, str] = {}
    _walk(state_dict, "", wanted, found)
    names = [found[i] for i in wanted if i in found]
    names += [f"<tensor {tuple(t.shape)} {t.dtype}>" for i, t in wanted.items() if i not in found]
    return names


def _walk(obj: object, path: str, wanted: dict[int, torch.Tensor], found: dict[int, str]) -> None:
    if isinstance(obj, DTensor):
        obj = dtensor_local(obj)
    if isinstance(obj, torch.Tensor):
        if id(obj) in wanted:
            found.setdefault(id(obj), path or "<root>")
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _walk(value, f"{path}.{key}" if path else str(key), wanted, found)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _walk(value, f"{path}.{index}" if path else str(index), wanted, found)


def current_rank() -> int | None:
    """This process's rank in the default group, or ``None`` without a group of several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


def snapshot_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A private copy of ``state_dict`` (tensors copied to host memory, outside any pool).

    Raises:
        SnapshotMutatedError: a tensor changed in place while it was being copied.
    """
    sources = collect_tensors(state_dict)
    guard = SnapshotGuard(sources)
    state: dict[str, Any] = rebuild(
        state_dict, {id(t): t.detach().to("cpu", copy=True) for t in sources}
    )
    changed = guard.changed()
    if changed:
        raise SnapshotMutatedError(tensor_paths(state_dict, changed))
    return state
