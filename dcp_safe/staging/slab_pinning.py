"""Page-locking the shared staging slabs, so device-to-host copies into them run at DMA speed.

A private pool buffer is pinned by torch's pinned allocator (``torch.empty(pin_memory=True)``).
A shared slab is memory torch did not allocate (an ``mmap`` of a ``memfd``), so it is
registered with the CUDA runtime instead (``cudaHostRegister``), once per slab when it is
created, and unregistered before the slab is let go. A worker process never registers its own
mapping: it only reads the slab to write it to storage. A slab the runtime refuses to lock
(``ulimit -l``, the driver) stays pageable: copies into it are slower, never wrong; the
stager's ``pinned_bytes`` shows how much is locked.

:class:`SlabPinning` is the seam: :class:`CudaSlabPinning` on a host with CUDA, a recording
double in the tests of a host without one.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["CudaSlabPinning", "SlabPinning"]

# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current
# one (a job that stages from several devices).
_PORTABLE = 1


class SlabPinning(Protocol):
    """Page-locks and releases host memory ranges."""

    def pin(self, pointer: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` from ``pointer``; raises :class:`OSError` if it cannot."""

    def unpin(self, pointer: int) -> None:
        """Release a range :meth:`pin` locked; raises :class:`OSError` if it cannot."""


class CudaSlabPinning:
    """:class:`SlabPinning` by the CUDA runtime (``cudaHostRegister`` / ``cudaHostUnregister``)."""

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
