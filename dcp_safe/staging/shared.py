"""Staging buffers in shared memory, which a worker process reads without a copy.

Buffers are carved from a few *slabs*, anonymous memory files (``memfd_create``) mapped here; a
worker maps each slab once, from its descriptor passed over a socket, and finds any buffer by
slab, offset and size (:class:`Place`). Each buffer is a tensor with a storage of exactly its
size, as the pool requires. Why slabs and not one share per tensor, why a SIGKILL of either side
leaks nothing, and how a slab is page-locked (or stays pageable when it cannot be): docs/staging.md,
"The transport" and "Pinned slabs". :class:`SlabPinning` is the seam: :class:`CudaSlabPinning`
on a host with CUDA, a recording double in the tests of a host without one.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)

_SLAB_BYTES = 64 << 20
# torch's own CPU allocator aligns to 64 bytes; typed views of a buffer need no more.
_ALIGN = 64


# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current
# one (a job that stages from several devices).
_PORTABLE = 1


class SlabPinning(Protocol):
    """Page-locks (``pin``) and releases (``unpin``) host memory ranges; OSError if it cannot."""

    def pin(self, pointer: int, nbytes: int) -> None: ...

    def unpin(self, pointer: int) -> None: ...


class CudaSlabPinning:
    def pin(self, pointer: int, nbytes: int) -> None:
        runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = int(runtime.cudaHostRegister(pointer, nbytes, _PORTABLE))
        if error:
            raise OSError(
                f"cudaHostRegister of a {nbytes}-byte staging slab failed (cudaError {error}):"
                " the locked-memory limit (ulimit -l) or the driver refused it"
            )

    def unpin(self, pointer: int) -> None:
        error = int(torch.cuda.cudart().cudaHostUnregister(pointer))  # type: ignore[no-untyped-call]
        if error:
            raise OSError(f"cudaHostUnregister of a staging slab failed (cudaError {error})")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Place:
    slab: int
    offset: int
    nbytes: int


@dataclass(eq=False)
class _Slab:
    id: int
    fd: int
    size: int
    map: mmap.mmap
    used: int = 0
    live: int = 0  # buffers of it still alive
    pinned: int | None = None  # the address page-locked, when it is


class SharedSlabs:
    """Allocates buffers in shared slabs (64 MiB ones for small buffers, page-locked by
    ``pinning``) and says where each one is; from any thread."""

    def __init__(self, pinning: SlabPinning | None = None) -> None:
        self.pinning = pinning
        self._lock = threading.RLock()
        self._slabs: dict[int, _Slab] = {}
        self._current: _Slab | None = None
        self._ids = itertools.count(1)
        self._places: dict[int, Place] = {}  # by the buffer's data pointer

    def allocate(self, size: int) -> torch.Tensor:
        # A uint8 tensor of ``size`` bytes in a slab (a private one for a large buffer).
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            current = self._current
            offset = 0 if current is None else _round_up(current.used, _ALIGN)
            if size * 4 > _SLAB_BYTES:
                slab, offset = self._new_slab(_round_up(size, mmap.PAGESIZE)), 0
            elif current is None or offset + size > current.size:
                slab, offset = self._new_slab(_SLAB_BYTES), 0
                self._current = slab
            else:
                slab = current
            slab.used = offset + size
            slab.live += 1
            buffer = torch.frombuffer(slab.map, dtype=torch.uint8, count=size, offset=offset)
            pointer = buffer.data_ptr()
            self._places[pointer] = Place(slab.id, offset, size)
        weakref.finalize(buffer, self._freed, pointer).atexit = False
        return buffer

    def place_of(self, tensor: torch.Tensor) -> Place | None:
        # Where ``tensor``'s whole storage lives; None when it is no buffer of ours.
        storage = tensor.untyped_storage()
        place = self._places.get(storage.data_ptr())
        return place if place is not None and place.nbytes == storage.nbytes() else None

    def slabs(self) -> dict[int, tuple[int, int]]:
        # id -> (a duplicate of its descriptor, its size): the caller owns (and closes) the
        # duplicates, so a slab closed meanwhile is no hazard.
        with self._lock:
            return {s.id: (os.dup(s.fd), s.size) for s in self._slabs.values()}

    def slab_ids(self) -> set[int]:
        with self._lock:
            return set(self._slabs)

    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._slabs.values() if s.pinned is not None)

    def close(self) -> None:
        # Buffers still alive keep their memory mapped (pageable from now on).
        with self._lock:
            for slab in self._slabs.values():
                self._unpin(slab)
                os.close(slab.fd)
            self._slabs.clear()
            self._current = None

    def _new_slab(self, size: int) -> _Slab:
        fd = os.memfd_create("dcp_safe-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        slab = _Slab(next(self._ids), fd, size, mapped)
        if self.pinning is not None:
            pointer = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
            try:
                self.pinning.pin(pointer, size)
                slab.pinned = pointer
            except OSError as exc:  # slower copies, never wrong ones: say so, go on
                log.warning("dcp_safe: a %d-byte staging slab stays pageable: %s", size, exc)
        self._slabs[slab.id] = slab
        return slab

    def _unpin(self, slab: _Slab) -> None:
        if slab.pinned is None or self.pinning is None:
            return
        pointer, slab.pinned = slab.pinned, None
        try:
            self.pinning.unpin(pointer)
        except OSError as exc:
            log.warning("dcp_safe: unlocking a staging slab failed: %s", exc)

    def _freed(self, pointer: int) -> None:
        # Runs when the pool dropped the buffer: no one here reads those bytes again.
        with self._lock:
            place = self._places.pop(pointer, None)
            slab = None if place is None else self._slabs.get(place.slab)
            if place is None or slab is None:
                return
            slab.live -= 1
            start = _round_up(place.offset, mmap.PAGESIZE)
            end = (place.offset + place.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            # Not in a locked slab: the runtime keeps the old pages, so a copy into pages the
            # kernel gave anew would land where no one reads. Its memory goes with the slab.
            if end > start and slab.pinned is None:
                slab.map.madvise(mmap.MADV_REMOVE, start, end - start)
            if slab.live > 0:
                return
            if slab is self._current:
                slab.used = 0  # empty: bump from its start again
                return
            del self._slabs[slab.id]
            self._unpin(slab)  # no buffer of it is left to copy into
            os.close(slab.fd)  # the map goes when its last view does
