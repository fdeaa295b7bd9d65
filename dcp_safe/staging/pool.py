"""Reusable host buffers for staged tensors, with exact byte accounting and safe release
(docs/staging.md, "Buffers and release", "Thousands of tensors").

Each staged tensor gets one buffer of exactly its byte size, so it owns its whole storage
(DCP's writers serialize whole storages and would clone a view of a larger slab). A *lease* is
one generation's buffers, released once: ``writer_done=True`` when the writer has returned
(straight back to the free lists), ``False`` when only the staged dict was dropped (a buffer
still viewed from outside stays *pending*). A request with a plan's *token* is kept whole as a
*bundle* with its typed views (the next lease of that plan, ready); bundled bytes count as free.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import cast

import torch

from dcp_safe.choices import parse_choice
from dcp_safe.errors import ConfigError
from dcp_safe.staging.shared import SharedSlabs
from dcp_safe.torch_compat import empty_host_cache, storage_use_count, tensor_use_count

# Small buffers gain nothing from pinning and each pinned block costs a driver call.
_PIN_MIN_BYTES = 64 << 10
# Makes a lease's typed views from its buffers (a plan's :meth:`StagingPlan.views`).
_MakeViews = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class PinMemory(str, Enum):
    """Whether staging buffers are page-locked (pinned) host memory."""

    AUTO = "auto"  # pinned when CUDA is available, pageable otherwise
    ON = "on"
    OFF = "off"

    @classmethod
    def coerce(cls, value: PinMemory | str | bool) -> PinMemory:
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        return parse_choice(cls, value, "pin_memory")

    def resolve(self) -> bool:
        """Whether to pin, on this host (ConfigError: ``ON`` without CUDA)."""
        if self is PinMemory.OFF:
            return False
        available = torch.cuda.is_available()
        if self is PinMemory.ON and not available:
            raise ConfigError("pin_memory='on' needs CUDA; use 'auto' or 'off' on this host")
        return available


@dataclass
class PoolStats:
    """Byte accounting of a pool (the meanings of :class:`StagerStats`, where
    ``allocated_bytes`` is ``pool_bytes``): a copy from :meth:`BufferPool.stats`, or the pool's
    running :attr:`BufferPool.counts`."""

    allocated_bytes: int = 0
    in_use_bytes: int = 0
    free_bytes: int = 0
    pending_bytes: int = 0
    pinned_bytes: int = 0
    peak_allocated_bytes: int = 0
    allocations: int = 0
    allocated_bytes_total: int = 0
    reuses: int = 0


def _storage_shared(buffer: torch.Tensor) -> bool:
    # The pool's tensor plus the temporary storage object make 2; more means an outside view.
    return storage_use_count(buffer) > 2


def _python_refs(views: list[torch.Tensor]) -> list[int]:
    return [sys.getrefcount(v) for v in views]


# What _python_refs reads for a tensor held by one list and nothing else (interpreters differ).
_OWN_REFS = _python_refs([torch.empty(0)])[0]


def _views_held(views: list[torch.Tensor], storage_counts: list[int]) -> bool:
    # Whether anyone but the pool still holds a cached view or reads its buffer.
    # ``storage_counts`` are the views' storage use counts when they were made: how many
    # references a view chain takes internally is torch's business, so it is measured.
    if max(_python_refs(views), default=0) > _OWN_REFS:
        return True  # the very tensor the staged dict held (a caller kept it)
    if any(tensor_use_count(v) > 1 for v in views):
        return True  # a C++ owner of the tensor itself (an async writer)
    return any(storage_use_count(v) > then for v, then in zip(views, storage_counts, strict=True))


@dataclass(frozen=True)
class BufferRequest:
    """The buffers one save needs: their sizes in order, their host cost (made by
    :meth:`BufferPool.request`: it depends on the pool's pinning), and its plan's token."""

    sizes: Sequence[int]
    cost: int
    nbytes: int
    token: int | None = None


@dataclass(eq=False)
class Lease:
    """One generation's buffers, one per requested size, in request order.

    The staging thread calls :meth:`materialize` and then reads :attr:`buffers`.
    :meth:`release` may be called from any thread, any number of times; the first counts.
    """

    _pool: BufferPool
    request: BufferRequest
    _buffers: list[torch.Tensor | None]
    # The typed views kept with a bundle, and their storage use counts when made.
    views: list[torch.Tensor] | None = None
    storage_counts: list[int] = field(default_factory=list)
    allocated_bytes: int = 0
    released: bool = False

    @property
    def buffers(self) -> list[torch.Tensor]:
        return cast(list[torch.Tensor], self._buffers)  # read after materialize() only

    def materialize(self) -> int:
        """Allocate the buffers that could not be reused; return the bytes allocated so far."""
        if self.views is None:  # a whole bundle has its views: nothing to look for
            for i, size in enumerate(self.request.sizes):
                if self._buffers[i] is None:
                    self._buffers[i] = self._pool._allocate(size)
                    self.allocated_bytes += size
        return self.allocated_bytes

    def typed_views(self, make: _MakeViews) -> list[torch.Tensor]:
        """The buffers' typed views: the bundle's, or ``make(buffers)`` kept for the next lease."""
        if self.views is None:
            self.views = make(self.buffers)
            self.storage_counts = list(map(storage_use_count, self.views))
        return self.views

    def release(self, *, writer_done: bool) -> None:
        # The two strengths: the module docstring.
        self._pool._release(self, writer_done=writer_done)


class BufferPool:
    """Host buffers reused across saves (in ``shared`` slabs when given), from any thread.

    :attr:`condition` is notified whenever bytes are released or freed, so an admission loop
    can wait on it.
    """

    def __init__(
        self, *, pin_memory: PinMemory | str | bool = "auto", shared: SharedSlabs | None = None
    ) -> None:
        # Shared slabs are pinned by their own pinning (``SharedSlabs(pinning=...)``), whole.
        self.pin = PinMemory.coerce(pin_memory).resolve() and shared is None
        self.shared = shared
        # Re-entrant: the stager holds it around pool calls, and a release may run inside a
        # finalizer on a thread that already holds it.
        self.condition = threading.Condition(threading.RLock())
        self._free: defaultdict[int, list[torch.Tensor]] = defaultdict(list)
        self._pending: list[torch.Tensor] = []
        self._bundles: dict[int, Lease] = {}
        # The running accounting; read it with the condition held for consistent values.
        self.counts = PoolStats()
        self._closed = False

    def cost(self, size: int) -> int:
        # Host bytes one buffer really takes: pinned blocks round up to a power of two.
        return 1 << (size - 1).bit_length() if self.pin and size >= _PIN_MIN_BYTES else size

    def request(self, sizes: Sequence[int], *, token: int | None = None) -> BufferRequest:
        cost = sum(map(self.cost, sizes)) if self.pin else sum(sizes)
        return BufferRequest(sizes=tuple(sizes), cost=cost, nbytes=sum(sizes), token=token)

    def plan(self, request: BufferRequest | Sequence[int]) -> tuple[int, int]:
        """``(reused, new)``: the host bytes of a request free buffers cover, and those to be
        allocated. Call with :attr:`condition` held."""
        request = self._as_request(request)
        self._reclaim_pending()
        if request.token in self._bundles:
            return request.cost, 0
        reused, new = self._plan_free(request)
        if new and self._bundles:  # other layouts' bundles are free bytes too
            self._break_bundles()
            reused, new = self._plan_free(request)
        return reused, new

    def lease(self, request: BufferRequest | Sequence[int]) -> Lease:
        """Take free buffers for a request and reserve the rest. Call with the condition held."""
        request = self._as_request(request)
        self.plan(request)  # reclaims pending buffers, breaks other bundles when they are needed
        counts = self.counts
        counts.in_use_bytes += request.cost
        bundle = self._bundles.pop(request.token, None) if request.token is not None else None
        if bundle is not None:
            counts.free_bytes -= request.cost
            counts.reuses += len(bundle.buffers)
            return bundle
        free = self._free
        buffers = [free[size].pop() if free.get(size) else None for size in request.sizes]
        taken = [self.cost(s) for s, b in zip(request.sizes, buffers, strict=True) if b is not None]
        counts.free_bytes -= sum(taken)
        counts.reuses += len(taken)
        counts.allocated_bytes += request.cost - sum(taken)
        counts.peak_allocated_bytes = max(counts.peak_allocated_bytes, counts.allocated_bytes)
        return Lease(self, request, buffers)

    def warm(self, request: BufferRequest | Sequence[int], views: _MakeViews | None = None) -> int:
        """Allocate and first-touch free buffers for a request; return the bytes allocated.

        Sizes free buffers cover are skipped (warming twice is free). With a token, ``views``
        makes the typed views kept with the bundle. Call without the condition held (allocation
        is slow); the caller checks the budget first.
        """
        with self.condition:
            _, new = self.plan(request)
            if new == 0:
                return 0
            lease = self.lease(request)
        allocated = lease.materialize()
        for buffer in lease.buffers:
            buffer.zero_()  # first touch now, so the first save does not fault pages in
        if views is not None:
            lease.typed_views(views)
        lease.release(writer_done=True)
        return allocated

    def trim(self, target_bytes: int = 0) -> int:
        # Free unused buffers until at most ``target_bytes`` of free ones remain; the bytes freed.
        freed = 0
        with self.condition:
            self._reclaim_pending()
            self._break_bundles()
            for size in sorted(self._free, reverse=True):
                bufs = self._free[size]
                while bufs and self.counts.free_bytes > target_bytes:
                    bufs.pop()
                    self.counts.free_bytes -= self.cost(size)
                    self._account_free(size)
                    freed += self.cost(size)
            self._free = defaultdict(list, {s: b for s, b in self._free.items() if b})
            self.condition.notify_all()
        if freed and self.pin:
            # Freed pinned blocks stay in torch's host cache until emptied; trim means give back.
            empty_host_cache()
        return freed

    def close(self) -> None:
        # Buffers still leased are freed when released.
        with self.condition:
            self._closed = True
        self.trim(0)

    def stats(self) -> PoolStats:
        with self.condition:
            self._reclaim_pending()
            pinned = self.counts.pinned_bytes if self.shared is None else self.shared.pinned_bytes()
            return replace(self.counts, pinned_bytes=pinned)

    def _allocate(self, size: int) -> torch.Tensor:
        pin = self.pin and size >= _PIN_MIN_BYTES
        if self.shared is not None:
            buffer = self.shared.allocate(size)
        else:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        with self.condition:
            self.counts.allocations += 1
            self.counts.allocated_bytes_total += self.cost(size)
            if pin:
                self.counts.pinned_bytes += self.cost(size)
        return buffer

    def _account_free(self, size: int) -> None:
        self.counts.allocated_bytes -= self.cost(size)
        if self.pin and size >= _PIN_MIN_BYTES:
            self.counts.pinned_bytes -= self.cost(size)

    def _release(self, lease: Lease, *, writer_done: bool) -> None:
        with self.condition:
            if lease.released:
                return
            lease.released = True
            self.counts.in_use_bytes -= lease.request.cost
            views, lease.views = lease.views, None
            token = lease.request.token
            if (
                token is not None
                and views is not None
                and not self._closed
                and (writer_done or not _views_held(views, lease.storage_counts))
            ):
                if token in self._bundles:  # another generation of this layout came back first
                    self._break_bundles()  # its buffers stay free, in the free lists
                self._bundles[token] = Lease(
                    self, lease.request, lease._buffers, views, lease.storage_counts
                )
                self.counts.free_bytes += lease.request.cost
            else:
                del views  # a view nobody else holds dies here, so its buffer counts as unshared
                for size, buffer in zip(lease.request.sizes, lease._buffers, strict=False):
                    if buffer is None:  # reserved, never allocated (staging failed early)
                        self.counts.allocated_bytes -= self.cost(size)
                    elif not writer_done and _storage_shared(buffer):
                        self._pending.append(buffer)
                        self.counts.pending_bytes += self.cost(size)
                    else:
                        self._put_free(buffer)
            lease._buffers = []
            self.condition.notify_all()

    def _as_request(self, request: BufferRequest | Sequence[int]) -> BufferRequest:
        return request if isinstance(request, BufferRequest) else self.request(request)

    def _plan_free(self, request: BufferRequest) -> tuple[int, int]:
        free = self._free
        wanted = Counter(request.sizes).items()
        reused = sum(self.cost(size) * min(n, len(free.get(size, ()))) for size, n in wanted)
        return reused, request.cost - reused

    def _break_bundles(self) -> None:
        # Their views die with them; the buffers join the free lists (already free bytes).
        for bundle in self._bundles.values():
            for buffer in bundle.buffers:
                self._free[buffer.numel()].append(buffer)
        self._bundles.clear()

    def _put_free(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        if self._closed:
            self._account_free(size)
        else:
            self._free[size].append(buffer)
            self.counts.free_bytes += self.cost(size)

    def _reclaim_pending(self) -> None:
        pending, self._pending = self._pending, []
        for buffer in pending:
            if _storage_shared(buffer):
                self._pending.append(buffer)
            else:
                self.counts.pending_bytes -= self.cost(buffer.numel())
                self._put_free(buffer)
