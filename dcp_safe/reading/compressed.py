"""Decompress a zstd tensor item of a known layout straight into its destination, verified.

The alternative, reading the compressed item whole, decompressing it into a second buffer and
decoding the tensor over that, holds about twice the item at once and, on many threads,
leaves glibc holding freed blocks (a 256 MiB zstd load grew the process by 226 MiB that way
under a 16 MiB budget). Here the compressed bytes are read in small pieces, each hashed in file
order (the checksum is of the stored, compressed bytes), and the payload is decompressed into
``dest``: what is held beyond ``dest`` is zstd's window and one input piece, whatever the
item's size. As in :mod:`dcp_safe.reading.tensors`, ``dest`` is written before the checksum is
compared; nothing reaches the planner unchecked.
"""

from __future__ import annotations

import io
from typing import IO, BinaryIO, cast

import torch
import zstandard

from dcp_safe.adapters.tensor_records import TensorLayout, tensor_bytes
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.streams import VerifyingSlice, read_fully

__all__ = ["STREAM_BYTES", "read_compressed_tensor"]

# Compressed bytes read at once, and the most bytes of payload decompressed per call.
_READ_BYTES = 256 << 10
_OUT_BYTES = 16 << 20
# The largest zstd window streamed (the writer's level 3 uses 2 MiB); a frame that needs more
# is decoded whole by the caller instead.
_MAX_WINDOW_BYTES = 4 << 20
#: What one streamed read holds beyond its destination, at most: the window and one read.
STREAM_BYTES = _MAX_WINDOW_BYTES + _READ_BYTES


class _Window(io.RawIOBase):
    """``[start, start + length)`` of ``stream``, read in order (no checksum)."""

    def __init__(self, stream: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._stream, self._left = stream, length
        stream.seek(start)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")[: self._left]
        got = read_fully(self._stream, view)
        self._left -= got
        return got


def read_compressed_tensor(
    stream: BinaryIO,
    *,
    path: str,
    item: str,
    start: int,
    length: int,
    layout: TensorLayout,
    checksum: str | None,
    dest: torch.Tensor,
) -> bool:
    """Decompress the zstd item at ``start`` (``length`` stored bytes) into ``dest`` (a
    contiguous CPU tensor of the layout's payload).

    ``checksum`` ``None`` reads without verifying. Returns ``False``, nothing verified and
    ``dest`` undefined, when the item does not decompress to ``layout``'s bytes around the
    payload within the window (the caller decodes it whole, and says what is wrong if
    anything is).

    Raises:
        CheckpointCorruptError: the file ends early, or the checksum differs.
    """
    if dest.numel() * dest.element_size() != layout.payload or not dest.is_contiguous():
        raise ValueError("destination does not fit the stored tensor")  # a caller's bug
    source = (
        _Window(stream, start, length)
        if checksum is None
        else VerifyingSlice(stream, start, length, checksum)
    )
    try:
        known = _decompress(source, layout, dest)
    except zstandard.ZstdError:
        return False
    if not known:
        return False
    if isinstance(source, VerifyingSlice):
        actual, whole = source.finish()
        if not whole:
            raise CheckpointCorruptError(path, "file is shorter than the manifest says", item=item)
        if actual != checksum:
            raise CheckpointCorruptError(
                path, "checksum mismatch", item=item, expected=checksum, actual=actual
            )
    return True


def _decompress(source: io.RawIOBase, layout: TensorLayout, dest: torch.Tensor) -> bool:
    reader = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW_BYTES).stream_reader(
        cast(IO[bytes], source), read_size=_READ_BYTES
    )
    with reader:
        prefix = bytearray(len(layout.prefix))
        if _fill(reader, memoryview(prefix)) != len(prefix) or bytes(prefix) != layout.prefix:
            return False
        target = tensor_bytes(dest)
        for at in range(0, layout.payload, _OUT_BYTES):
            chunk = target[at : at + _OUT_BYTES]
            if _fill(reader, chunk) != chunk.nbytes:
                return False
        suffix = bytearray(len(layout.suffix) + 1)  # one more: the item must end there
        got = _fill(reader, memoryview(suffix))
        return got == len(layout.suffix) and layout.matches(prefix, memoryview(suffix)[:got])


def _fill(reader: zstandard.ZstdDecompressionReader, view: memoryview) -> int:
    total = 0
    while total < view.nbytes:
        got = reader.readinto(view[total:])
        if not got:
            break
        total += got
    return total
