"""One save's staged copy (a *generation*) and the copy itself, as the staging thread runs it.

Each chunk is copied only after its sources' storages are found to still hold their bytes: a
storage freed under its tensor (as FSDP frees an unsharded parameter) moves no version counter,
and copying it would read released memory (docs/staging.md, "A snapshot of one moment").
Admission and release stay in :mod:`dcp_safe.staging.stager`.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.observe import SpanHandle
from dcp_safe.staging._tree import Layout
from dcp_safe.staging.guard import SnapshotGuard, tensor_paths
from dcp_safe.staging.plan import StagingPlan
from dcp_safe.staging.pool import Lease
from dcp_safe.torch_compat import foreach_copy

# Mapped over a chunk's sources: the storage check before its copy.
_read_data_ptr = torch.Tensor.data_ptr


class StagedStateDict(dict[str, Any]):
    """The staged state: a plain dict that can carry the weak reference that releases it."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False)
class InFlightGeneration:
    """One admitted save: its plan, lease, guard and staging span, until it is released.

    Not :class:`dcp_safe.staging.capacity.Generation`, the planner's byte sizes of one.
    """

    number: int
    lease: Lease
    span: SpanHandle  # the staging span: admission wait + copy
    guard: SnapshotGuard | None
    plan: StagingPlan
    rank: int | None = None  # this process's rank in a group of several (errors name it)
    started: float = 0.0  # perf_counter at the request
    ready: torch.cuda.Event | None = None  # the caller's stream's event the copy waits for
    release_claimed: bool = False
    tracked: bool = False
    staged: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # False while ``plan`` is stage()'s guess, not yet checked against the state's key.
    confirmed: bool = True
    # ``track(keep=tag)``: kept after a successful upload, under this tag, with its staged
    # dict held strongly (else DCP dropping it would release the buffers).
    keep: object | None = None
    result: weakref.ref[StagedStateDict] | None = None
    held: StagedStateDict | None = None

    def mutated(self, state_dict: dict[str, Any], tensors: list[torch.Tensor]) -> BaseException:
        """The error of a torn generation, naming ``tensors`` by their paths in ``state_dict``."""
        return SnapshotMutatedError(tensor_paths(state_dict, tensors), rank=self.rank)

    def torn(
        self, state_dict: dict[str, Any], cause: BaseException | None = None
    ) -> BaseException | None:
        """The guard's verdict once the copy is over (or failed with ``cause``): a
        :class:`SnapshotMutatedError` from ``cause`` when a source moved, else ``cause``."""
        changed = [] if self.guard is None else self.guard.changed()
        if isinstance(cause, SnapshotMutatedError) or not changed:
            return cause
        error = self.mutated(state_dict, changed)
        error.__cause__ = cause
        return error


def copy_sources(
    gen: InFlightGeneration,
    layout: Layout,
    stream: torch.cuda.Stream | None,
    profile: AbstractContextManager[Any],
    state_dict: dict[str, Any],
) -> dict[int, torch.Tensor]:
    """Copy every source of ``layout`` into its pool buffer; return the staged tensors by id.

    Raises:
        SnapshotMutatedError: a source's storage was freed or shrunk (see the module docstring).
    """
    stream_ctx: AbstractContextManager[Any] = (
        torch.cuda.stream(stream) if stream is not None else nullcontext()
    )
    plan = gen.plan
    dsts = gen.lease.typed_views(plan.views)
    srcs = plan.copied(layout)
    held = plan.held_pointers
    with torch.no_grad(), stream_ctx, profile:
        if gen.ready is not None and stream is not None:
            stream.wait_event(gen.ready)
        for start, stop in plan.chunks:
            chunk = srcs[start:stop]
            now = list(map(_read_data_ptr, chunk))
            if now != held[start:stop]:
                # Check the sources whose pointer moved; remember the ones that hold their
                # bytes. A pointer once found so is trusted while it stays put: coming back to
                # the same address with fewer bytes takes a storage shrunk twice between saves.
                lost = []
                for index, tensor, pointer in zip(range(start, stop), chunk, now, strict=True):
                    if held[index] != pointer and holds_its_bytes(tensor):
                        held[index] = pointer
                    elif held[index] != pointer:
                        lost.append(tensor)
                if lost:
                    raise gen.mutated(state_dict, lost)
            foreach_copy(dsts[start:stop], chunk, plan.any_cuda)
    if stream is not None:
        stream.synchronize()
    return plan.staged(layout, dsts)


def holds_its_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is allocated and reaches its last element (dense, strided)."""
    if tensor.numel() == 0:
        return True
    storage = tensor.untyped_storage()
    if storage.data_ptr() == 0:
        return False
    last = tensor.storage_offset() + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return storage.nbytes() >= (last + 1) * tensor.element_size()
