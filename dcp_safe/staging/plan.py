"""Per-layout staging plans (docs/staging.md, "Thousands of tensors"), and one save's staged
copy (a *generation*) as the staging thread copies it.

The key is compared, never keyed on identity: the same dict is mutated between saves, and a
rebuilt optimizer keeps the layout but not the tensors' ids. Its per-tensor part costs about
2 µs a tensor, so :meth:`PlanCache.speculate` offers the last plan on the walk's containers
alone and the stager confirms the full key on its staging thread.

Each chunk is copied only after its sources' storages are found to still hold their bytes: a
storage freed under its tensor (as FSDP frees an unsharded parameter) moves no version counter,
and copying it would read released memory (docs/staging.md, "A snapshot of one moment").
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dcp_safe.errors import SnapshotMutatedError
from dcp_safe.observe import Phase, Recorder, SpanHandle
from dcp_safe.staging._tree import Layout, stageable
from dcp_safe.staging.guard import SnapshotGuard, tensor_paths
from dcp_safe.staging.pool import BufferPool, Lease
from dcp_safe.torch_compat import foreach_copy

# A chunk ends after this many tensors or bytes, whichever comes first.
_CHUNK_TENSORS = 1024
_CHUNK_BYTES = 64 << 20
# Layouts remembered at once: a model and its optimizer saved apart, plus a spare.
_MAX_PLANS = 4


class StagingPlan:
    """What staging one layout takes, computed from its first walk.

    The *copied* sources are the distinct stageable candidates that hold bytes; an empty one is
    staged as a fresh tensor. ``chunks`` are ``(start, stop)`` ranges of the copied sources, one
    ``_foreach_copy_`` each; ``held_pointers`` holds, per copied source, the data pointer last
    found holding its bytes (read and updated by the stager's one staging thread).
    """

    def __init__(self, layout: Layout, pool: BufferPool, token: int) -> None:
        candidates = layout.candidates
        first: dict[int, int] = {}  # each distinct stageable tensor's first index
        for index, tensor in enumerate(candidates):
            if stageable(tensor):
                first.setdefault(id(tensor), index)
        copied = [i for i in first.values() if candidates[i].nbytes > 0]
        self._empty = [i for i in first.values() if candidates[i].nbytes == 0]
        self.key, self.structure, self.count = layout.key, layout.structure, len(candidates)
        # None: every candidate is copied, in order (the common case; no selection per save).
        self._copied = None if len(copied) == len(candidates) else copied
        sources = [candidates[i] for i in copied]
        self._types = [(t.dtype, t.shape) for t in sources]
        sizes = [t.nbytes for t in sources]
        self.any_cuda = any(t.is_cuda for t in sources)
        self.request = pool.request(sizes, token=token)
        self.chunks = _chunks(sizes)
        # -1: not checked yet (no data pointer is negative; a freed storage's is 0).
        self.held_pointers: list[int] = [-1] * len(copied)

    def copied(self, layout: Layout) -> list[torch.Tensor]:
        # ``layout`` must have this plan's key.
        values = layout.candidates
        return values if self._copied is None else [values[i] for i in self._copied]

    def views(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        return [b.view(d).view(s) for b, (d, s) in zip(buffers, self._types, strict=True)]

    def staged(self, layout: Layout, dsts: list[torch.Tensor]) -> dict[int, Any]:
        # The staged copy per source ``id``: the views, and a fresh tensor per empty source.
        staged: dict[int, Any] = dict(zip(map(id, self.copied(layout)), dsts, strict=True))
        for empty in map(layout.candidates.__getitem__, self._empty):
            staged[id(empty)] = torch.empty(empty.shape, dtype=empty.dtype)
        return staged


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    chunks: list[tuple[int, int]] = []
    start = held = 0
    for stop, size in enumerate(sizes, 1):
        held += size
        if stop - start >= _CHUNK_TENSORS or held >= _CHUNK_BYTES or stop == len(sizes):
            chunks.append((start, stop))
            start, held = stop, 0
    return chunks


class PlanCache:
    """The plans of the last few layouts a stager saw (the stager holds its condition)."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._plans: OrderedDict[tuple[Any, ...], StagingPlan] = OrderedDict()
        self.builds = self.hits = 0
        # Not ``next(reversed(self._plans.values()))``: that looks the key up again, and a
        # layout key (tuples per tensor) is not hash-cached: milliseconds at 10,000 tensors.
        self._latest: StagingPlan | None = None

    def speculate(
        self, layout: Layout, admits: Callable[[StagingPlan], bool]
    ) -> StagingPlan | None:
        """The latest plan, if ``layout`` has its structure and its number of tensors and
        ``admits`` (the stager's test) takes it now; else None.

        A guess, not a match: the shapes, dtypes, devices and aliasing are not compared (that
        is the key's cost), so the caller must confirm it against the layout's key before
        anything staged with it is used.
        """
        plan = self._latest
        if plan is None or plan.count != len(layout.candidates):
            return None
        if plan.structure != layout.structure or not admits(plan):
            return None
        self.hits += 1
        return plan

    def get(self, layout: Layout) -> StagingPlan:
        plan = self._plans.get(layout.key)
        if plan is not None:
            self._plans.move_to_end(layout.key)
            self.hits += 1
        else:
            self.builds += 1  # also the plan's token: unique in the pool
            plan = self._plans[layout.key] = StagingPlan(layout, self._pool, self.builds)
            if len(self._plans) > _MAX_PLANS:
                self._plans.popitem(last=False)  # its pooled views go when the pool needs them
        self._latest = plan
        return plan


# Mapped over a chunk's sources: the storage check before its copy.
_read_data_ptr = torch.Tensor.data_ptr


class StagedStateDict(dict[str, Any]):
    """The staged state: a dict that can carry the weak reference that releases it."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False)
class InFlightGeneration:
    """One admitted save until it is released (not the planner's
    :class:`~dcp_safe.staging.capacity.Generation`)."""

    number: int
    lease: Lease
    span: SpanHandle  # the staging span: admission wait + copy
    guard: SnapshotGuard | None
    plan: StagingPlan
    rank: int | None  # this process's rank in a group of several (errors name it)
    started: float  # perf_counter at the request
    # False when stage() took ``plan`` as a guess: the copy checks it against the state's key.
    confirmed: bool
    ready: torch.cuda.Event | None = None  # the caller's stream's event the copy waits for
    release_claimed: bool = False
    tracked: bool = False
    error: BaseException | None = None
    # ``track(keep=tag)``: kept after a successful upload, under this tag, with its staged
    # dict held strongly (else DCP dropping it would release the buffers).
    keep: object | None = None
    result: weakref.ref[StagedStateDict] | None = None
    held: StagedStateDict | None = None

    def torn(
        self, state_dict: dict[str, Any], cause: BaseException | None = None
    ) -> BaseException | None:
        # The guard's verdict once the copy is over (or failed with ``cause``): a
        # SnapshotMutatedError from ``cause`` when a source moved, else ``cause``.
        changed = [] if self.guard is None else self.guard.changed()
        if isinstance(cause, SnapshotMutatedError) or not changed:
            return cause
        error = SnapshotMutatedError(tensor_paths(state_dict, changed), rank=self.rank)
        error.__cause__ = cause
        return error


def copy_sources(
    gen: InFlightGeneration,
    layout: Layout,
    stream: torch.cuda.Stream | None,
    recorder: Recorder,
    state_dict: dict[str, Any],
) -> dict[int, torch.Tensor]:
    """Copy every source of ``layout`` into its pool buffer; return the staged tensors by id
    (SnapshotMutatedError when a source's storage was freed or shrunk: the module docstring)."""
    plan = gen.plan
    dsts = gen.lease.typed_views(plan.views)
    srcs = plan.copied(layout)
    held = plan.held_pointers
    with torch.no_grad(), torch.cuda.stream(stream), recorder.profile(Phase.STAGING):
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
                    raise SnapshotMutatedError(tensor_paths(state_dict, lost), rank=gen.rank)
            foreach_copy(dsts[start:stop], chunk, plan.any_cuda)
    if stream is not None:
        stream.synchronize()
    return plan.staged(layout, dsts)


def holds_its_bytes(tensor: torch.Tensor) -> bool:
    # Whether the storage is allocated and reaches the last element (dense, strided).
    if tensor.numel() == 0:
        return True
    storage = tensor.untyped_storage()
    if storage.data_ptr() == 0:
        return False
    last = tensor.storage_offset() + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return storage.nbytes() >= (last + 1) * tensor.element_size()
