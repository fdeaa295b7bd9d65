"""Per-layout staging plans: what one state-dict layout needs, worked out once and reused.

What a layout key covers and what a plan holds: docs/staging.md, "Thousands of tensors". The key
is compared, never keyed on identity: the same dict is mutated between saves, and a rebuilt
optimizer keeps the layout but not the tensors' ids. Its per-tensor part costs about 2 µs a
tensor, so :meth:`PlanCache.speculate` offers the last plan on the walk's containers alone and
the stager confirms the full key on its staging thread. Chunks keep the storage check
(:mod:`dcp_safe.staging.generation`) just before the bytes it covers while the copy stays one
call per chunk.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from dcp_safe.staging._tree import Layout, stageable
from dcp_safe.staging.pool import BufferPool

# A chunk ends after this many tensors or bytes, whichever comes first.
_CHUNK_TENSORS = 1024
_CHUNK_BYTES = 64 << 20
# Layouts remembered at once: a model and its optimizer saved apart, plus a spare.
_MAX_PLANS = 4


class StagingPlan:
    """What staging one layout takes, computed from its first walk.

    The *copied* sources are the distinct stageable candidates that hold bytes; an empty one is
    staged as a fresh tensor.

    Attributes:
        key: the layout key it was built for.
        request: the buffers it leases (sizes, host cost, and the token its views are kept by).
        nbytes: bytes staged per save.
        any_cuda: whether any copied source is on a CUDA device.
        chunks: ``(start, stop)`` ranges of the copied sources, one ``_foreach_copy_`` each.
        held_pointers: per copied source, the data pointer last found holding its bytes; read
            and updated by the stager's one staging thread (:mod:`dcp_safe.staging.generation`).
    """

    def __init__(self, layout: Layout, pool: BufferPool, token: int) -> None:
        candidates = layout.candidates
        seen: set[int] = set()
        copied: list[int] = []
        self._empty: list[tuple[int, torch.Size, torch.dtype]] = []
        for index, tensor in enumerate(candidates):
            if id(tensor) in seen or not stageable(tensor):
                continue
            seen.add(id(tensor))
            if tensor.nbytes > 0:
                copied.append(index)
            else:
                self._empty.append((index, tensor.shape, tensor.dtype))
        self.key, self.structure, self.count = layout.key, layout.structure, len(candidates)
        # None: every candidate is copied, in order (the common case; no selection per save).
        self._copied = None if len(copied) == len(candidates) else copied
        sources = [candidates[i] for i in copied]
        self._types = [(t.dtype, t.shape) for t in sources]
        sizes = [t.nbytes for t in sources]
        self.nbytes = sum(sizes)
        self.any_cuda = any(t.is_cuda for t in sources)
        self.request = pool.request(sizes, token=token)
        self.chunks = _chunks(sizes)
        # -1: not checked yet (no data pointer is negative; a freed storage's is 0).
        self.held_pointers: list[int] = [-1] * len(copied)

    def copied(self, layout: Layout) -> list[torch.Tensor]:
        """The copied sources of ``layout`` (which must have this plan's key), in request order."""
        values = layout.candidates
        return values if self._copied is None else [values[i] for i in self._copied]

    def views(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each buffer viewed as its tensor's dtype and shape, in request order."""
        return [b.view(d).view(s) for b, (d, s) in zip(buffers, self._types, strict=True)]

    def staged(self, layout: Layout, dsts: list[torch.Tensor]) -> dict[int, Any]:
        """The staged copy per source ``id``: the views, and a fresh tensor per empty source."""
        staged: dict[int, Any] = dict(zip(map(id, self.copied(layout)), dsts, strict=True))
        for index, shape, dtype in self._empty:
            staged[id(layout.candidates[index])] = torch.empty(shape, dtype=dtype)
        return staged


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    chunks: list[tuple[int, int]] = []
    start = held = 0
    for index, size in enumerate(sizes):
        held += size
        if index + 1 - start >= _CHUNK_TENSORS or held >= _CHUNK_BYTES:
            chunks.append((start, index + 1))
            start, held = index + 1, 0
    if start < len(sizes):
        chunks.append((start, len(sizes)))
    return chunks


class PlanCache:
    """The plans of the last few layouts a stager saw, most recent first.

    Not thread-safe: the stager calls it with its condition held.
    """

    def __init__(self, pool: BufferPool, max_plans: int = _MAX_PLANS) -> None:
        self._pool = pool
        self._max = max_plans
        self._plans: OrderedDict[tuple[Any, ...], StagingPlan] = OrderedDict()
        self._tokens = itertools.count(1)
        self.builds = self.hits = 0
        # Not ``next(reversed(self._plans.values()))``: that looks the key up again, and a
        # layout key (tuples per tensor) is not hash-cached: milliseconds at 10,000 tensors.
        self._latest: StagingPlan | None = None

    def speculate(
        self, layout: Layout, admits: Callable[[StagingPlan], bool]
    ) -> StagingPlan | None:
        """The latest plan, if ``layout`` has its structure and its number of tensors and
        ``admits`` (the stager's test) takes it now.

        A guess, not a match: the shapes, dtypes, devices and aliasing are not compared (that
        is the key's cost), so the caller must confirm it against the layout's key before
        anything staged with it is used. ``None``: no plan, the structure changed, or refused.
        """
        plan = self._latest
        if plan is None or plan.count != len(layout.candidates):
            return None
        if plan.structure != layout.structure or not admits(plan):
            return None
        self.hits += 1
        return plan

    def retract(self) -> None:
        """Un-count the last :meth:`speculate` hit: its plan did not match after all."""
        self.hits -= 1

    def get(self, layout: Layout) -> StagingPlan:
        """The plan for ``layout``: the cached one while its key holds, else a new one."""
        plan = self._plans.get(layout.key)
        if plan is not None:
            self._plans.move_to_end(layout.key)
            self.hits += 1
        else:
            plan = self._plans[layout.key] = StagingPlan(layout, self._pool, next(self._tokens))
            self.builds += 1
            if len(self._plans) > self._max:
                self._plans.popitem(last=False)  # its pooled views go when the pool needs them
        self._latest = plan
        return plan
