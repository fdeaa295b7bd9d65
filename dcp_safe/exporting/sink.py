"""Output bytes: an append-only sink that hashes what it writes, and tensors written through it.

No ``seek``: each file's SHA-256 is computed as it is written, and :mod:`zipfile` writes the
torch format sequentially (sizes and CRCs in a descriptor after each record).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from dcp_safe.adapters.tensor_records import tensor_bytes
from dcp_safe.manifest.streams import WritableFile

__all__ = ["SLICE_BYTES", "Sha256Sink", "Writes", "write_tensor"]

#: Bytes written (and cast) per call: small next to any tensor worth streaming, large enough
#: that a call's overhead does not show.
SLICE_BYTES = 16 << 20


class Writes(Protocol):
    """Anything bytes can be written to (a sink, a zip record)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int | None: ...


class Sha256Sink:
    """Forwards writes to ``target`` (at offset 0) and hashes them; not seekable, by design."""

    def __init__(self, target: WritableFile) -> None:
        self._target: WritableFile | None = target
        self._hash = hashlib.sha256()
        self._written = 0

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        view = memoryview(data)
        self._hash.update(view)
        if self._target is not None:
            self._target.write(view)
        self._written += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        """Nothing to do: the backend flushes and fsyncs the file when it is closed."""

    def close(self) -> None:
        """Nothing to do: the file belongs to whoever opened it."""

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def discard(self) -> None:
        """Drop every later write: the file is being thrown away after a failure, and a
        writer winding down (a zip archive closing) must not fail on it again."""
        self._target = None


def write_tensor(sink: Writes, tensor: torch.Tensor, out_dtype: torch.dtype) -> int:
    """Write a CPU tensor's bytes as ``out_dtype`` from its own memory, in slices of
    :data:`SLICE_BYTES` (a cast goes through one reused slice-sized buffer); the bytes written."""
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():  # never for the reader's fresh tensors; cheap to guard
        flat = flat.contiguous()
    step = max(1, SLICE_BYTES // max(tensor.element_size(), out_dtype.itemsize))
    cast = (
        None if flat.dtype == out_dtype else torch.empty(min(step, flat.numel()), dtype=out_dtype)
    )
    written = 0
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        if cast is not None:
            piece = cast[: piece.numel()].copy_(piece)
        view = tensor_bytes(piece)
        sink.write(view)
        written += view.nbytes
    return written
