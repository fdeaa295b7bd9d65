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
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dcp_safe.staging._tree import ATOMIC, stageable
from dcp_safe.staging.pool import BufferPool
from dcp_safe.torch_compat import dtensor_local

__all__ = ["Layout", "PlanCache", "StagingPlan", "scan"]

# A chunk ends after this many tensors or bytes, whichever comes first.
_CHUNK_TENSORS = 1024
_CHUNK_BYTES = 64 << 20
# Layouts remembered at once: a model and its optimizer saved apart, plus a spare.
_MAX_PLANS = 4

# C getters mapped over the candidates: a fraction of a microsecond per tensor each.
_shape = torch.Tensor.shape.__get__  # type: ignore[attr-defined]
_dtype = torch.Tensor.dtype.__get__  # type: ignore[attr-defined]
_device = torch.Tensor.device.__get__  # type: ignore[attr-defined]
_layout = torch.Tensor.layout.__get__  # type: ignore[attr-defined]
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter


class Layout:
    """One walk of a state dict: its candidate tensors, in walk order, and its layout key.

    The key is computed on first use: the walk alone is what ``stage()`` pays on the training
    thread while the state's structure is unchanged (see :meth:`PlanCache.speculate`).
    """

    __slots__ = ("_key", "candidates", "structure")

    def __init__(self, candidates: list[torch.Tensor], structure: tuple[Any, ...]) -> None:
        self.candidates = candidates
        self.structure = structure
        self._key: tuple[Any, ...] | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        """The full layout key (see the module docstring); about 2 µs a tensor."""
        if self._key is None:
            self._key = _key(self.structure, self.candidates)
        return self._key


def scan(state: object) -> Layout:
    """Walk ``state`` once: the tensors DCP's planner would see, and its containers."""
    candidates: list[torch.Tensor] = []
    structure: list[Any] = []
    _visit(state, candidates, structure)
    return Layout(candidates, tuple(structure))


def _key(structure: tuple[Any, ...], candidates: list[torch.Tensor]) -> tuple[Any, ...]:
    ids = list(map(id, candidates))
    aliases = None
    if len(set(ids)) != len(ids):  # a tensor reached twice: which entries share is layout too
        first: dict[int, int] = {}
        aliases = tuple(first.setdefault(i, n) for n, i in enumerate(ids))
    return (
        structure,
        tuple(map(_shape, candidates)),
        tuple(map(_dtype, candidates)),
        tuple(map(_device, candidates)),
        tuple(map(_layout, candidates)),
        aliases,
    )


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
        elif kind not in ATOMIC:
            _visit(value, candidates, structure)


class StagingPlan:
    """What staging one layout takes, computed from its first walk.

    Attributes:
        key: the layout key it was built for.
        request: the buffers it leases (sizes, host cost, and the token its views are kept by).
        nbytes: bytes staged per save.
        any_cuda: whether any staged source is on a CUDA device.
        held_pointers: per copied source, the data pointer last found holding its bytes; read
            and updated by the stager's one staging thread (:mod:`dcp_safe.staging.generation`).
    """

    def __init__(self, layout: Layout, pool: BufferPool, token: int) -> None:
        candidates = layout.candidates
        seen: set[int] = set()
        picked: list[int] = []
        for index, tensor in enumerate(candidates):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                if stageable(tensor):
                    picked.append(index)
        self.key = layout.key
        self.structure = layout.structure
        self.count = len(candidates)
        # None: every candidate is staged, in order (the common case; no selection per save).
        self._picked = None if len(picked) == len(candidates) else picked
        sources = [candidates[i] for i in picked]
        copied = [i for i, t in enumerate(sources) if t.nbytes > 0]
        self._copied = None if len(copied) == len(sources) else copied
        self._empty = [(i, t.shape, t.dtype) for i, t in enumerate(sources) if t.nbytes == 0]
        self._shapes = [sources[i].shape for i in copied]
        self._dtypes = [sources[i].dtype for i in copied]
        sizes = [sources[i].nbytes for i in copied]
        self.nbytes = sum(sizes)
        self.any_cuda = any(t.is_cuda for t in sources)
        self.request = pool.request(sizes, token=token)
        self._chunks = _chunks(sizes)
        # -1: not checked yet (no data pointer is negative; a freed storage's is 0).
        self.held_pointers: list[int] = [-1] * len(copied)

    def sources(self, layout: Layout) -> list[torch.Tensor]:
        """The distinct stageable tensors of ``layout`` (which must have this plan's key)."""
        return self.pick(layout.candidates)

    def pick(self, values: list[Any]) -> list[Any]:
        """``values`` (one per candidate of a layout with this key) narrowed to the sources."""
        return values if self._picked is None else [values[i] for i in self._picked]

    def matches(self, layout: Layout) -> bool:
        """Whether ``layout`` has this plan's key (computes the key when not yet done)."""
        return layout.key == self.key

    def views(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each buffer viewed as its tensor's dtype and shape, in request order."""
        return [
            b.view(dtype).view(shape)
            for b, dtype, shape in zip(buffers, self._dtypes, self._shapes, strict=True)
        ]

    def copied(self, values: list[Any]) -> list[Any]:
        """``values`` (one per source) narrowed to the sources that hold bytes."""
        return values if self._copied is None else [values[i] for i in self._copied]

    def chunks(self) -> list[tuple[int, int]]:
        """``(start, stop)`` ranges of the copied sources, one ``_foreach_copy_`` each."""
        return self._chunks

    def staged(self, sources: list[torch.Tensor], dsts: list[torch.Tensor]) -> dict[int, Any]:
        """The staged copy per source ``id``: the views, and a fresh tensor per empty source."""
        staged: dict[int, Any] = dict(zip(map(id, self.copied(sources)), dsts, strict=True))
        for index, shape, dtype in self._empty:
            staged[id(sources[index])] = torch.empty(shape, dtype=dtype)
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

    def speculate(self, layout: Layout) -> StagingPlan | None:
        """The latest plan, if ``layout`` has its structure and its number of tensors.

        A guess, not a match: the shapes, dtypes, devices and aliasing are not compared (that
        is the key's cost), so the caller must confirm it with :meth:`StagingPlan.matches`
        before anything staged with it is used. ``None``: no plan, or the structure changed.
        """
        plan = self._latest
        if plan is None:
            return None
        if plan.count != len(layout.candidates) or plan.structure != layout.structure:
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
            self._latest = plan
            return plan
        plan = StagingPlan(layout, self._pool, next(self._tokens))
        self._plans[layout.key] = plan
        self._latest = plan
        self.builds += 1
        if len(self._plans) > self._max:
            self._plans.popitem(last=False)  # its pooled views go when the pool needs them
        return plan
