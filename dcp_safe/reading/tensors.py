"""Read a stored tensor item of a known layout straight into its destination, verified.

The bytes go from the file into the destination with one copy while the whole item is hashed in
file order; large items in chunks, each hashed on a helper thread while the next is read, so
verification costs about max(read, hash). A zstd item is read in small pieces, each hashed in
file order (the checksum is of the stored, compressed bytes), and its payload decompressed into
the destination: what is held beyond it is zstd's window and one input piece, whatever the
item's size (reading it whole and decompressing into a second buffer held about twice the item,
and on many threads left glibc holding freed blocks: a 256 MiB zstd load grew the process by
226 MiB that way under a 16 MiB budget). The destination is written before the checksum is
compared: a mismatch raises and leaves the state dict partly written, as any failed DCP load
does, but nothing reaches the planner unchecked.
"""

from __future__ import annotations

import io
import math
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, BinaryIO, cast

import torch
import zstandard

from dcp_safe.adapters.tensor_records import TensorLayout, layout_for, tensor_bytes
from dcp_safe.checkpoints.items import ZSTD_DESCRIPTOR
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.checksum import Hasher, format_checksum, new_hasher
from dcp_safe.manifest.schema import ItemRecord
from dcp_safe.manifest.streams import VerifyingSlice, read_fully, short_read

__all__ = [
    "STREAM_BYTES",
    "known_layout",
    "read_tensor_item",
    "require_stored",
    "transient_bytes",
    "transient_tensor",
]

# Items up to this size are read whole into memory in one call (one syscall, one hash call).
_WHOLE_MAX_BYTES = 1 << 20
# Chunks of large items: big enough to amortise a call, small enough that hashing one overlaps
# reading the next.
_CHUNK_BYTES = 16 << 20
# zstd items: compressed bytes read at once, and the most bytes of payload decompressed per call.
_READ_BYTES = 256 << 10
_OUT_BYTES = 16 << 20
# The largest zstd window streamed (the writer's level 3 uses 2 MiB); a frame that needs more
# is decoded whole by the caller instead.
_MAX_WINDOW_BYTES = 4 << 20
#: What one streamed zstd read holds beyond its destination, at most: the window and one read.
STREAM_BYTES = _MAX_WINDOW_BYTES + _READ_BYTES


def transient_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor for bytes held only while one item is read, mapped on its own when large
    so that its pages go back to the OS as soon as it is dropped. From ``malloc``, glibc keeps
    freed blocks in each reader thread's arena: 16 MiB items loaded on 8 threads under a
    16 MiB budget grew the process by ~240 MiB that way, as much as the budget saved."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _WHOLE_MAX_BYTES:
        return torch.empty(shape, dtype=dtype)
    # Unmapped when the last view of the tensor goes (the tensor holds the map).
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def require_stored(stream: BinaryIO, path: str, item: str, record: ItemRecord) -> None:
    """Refuse an item that reaches past the end of its file, before anything is allocated
    for it: its length is the manifest's word, the file's size is not (a 1.8 KiB checkpoint
    that declared a 4 GiB item cost 4 GiB on every restore before the short read). Every
    allocation for an item is then bounded by the file: its stored bytes, or what a chunk of
    its declared shape holds, which the metadata's decoder bounds by those bytes (or by
    ``ZSTD_MAX_RATIO`` times them, compressed, filled only as far as they decompress).

    Raises:
        CheckpointCorruptError: the file ends before the item does.
    """
    fileno = getattr(stream, "fileno", None)
    try:
        size = os.fstat(fileno()).st_size if fileno is not None else None
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        size = None
    if size is None:
        size = getattr(stream, "size", None)  # an fsspec file knows it from its open
    if not isinstance(size, int):
        at = stream.tell()
        size = stream.seek(0, os.SEEK_END)
        stream.seek(at)
    if record.start + record.length > size:
        raise short_read(path, item, record.length, max(0, size - record.start))


def known_layout(
    dtype: torch.dtype, shape: tuple[int, ...], record: ItemRecord
) -> TensorLayout | None:
    """The layout of a tensor item read here without ``torch.load``: an uncompressed one of
    the layout's length, or a zstd one (checked as it decompresses); ``None``: another item."""
    layout = layout_for(dtype, shape)
    if layout is None or record.transforms not in ((), (ZSTD_DESCRIPTOR,)):
        return None
    return layout if record.transforms or layout.length == record.length else None


def read_tensor_item(
    stream: BinaryIO,
    *,
    path: str,
    item: str,
    record: ItemRecord,
    layout: TensorLayout,
    checksum: str | None,
    dest: torch.Tensor,
    hash_pool: ThreadPoolExecutor | None = None,
) -> bool:
    """Read ``record``'s item into ``dest`` (a contiguous CPU tensor of the layout's payload),
    decompressing a zstd one.

    ``checksum`` ``None`` reads without verifying. Returns ``False``, with ``dest`` undefined
    and nothing verified, when the bytes around the payload are not ``layout``'s, or a zstd
    frame needs a larger window (the caller decodes the item whole, and says what is wrong).

    Raises:
        CheckpointCorruptError: the file is short, or the checksum differs.
    """
    if dest.numel() * dest.element_size() != layout.payload or not dest.is_contiguous():
        raise ValueError("destination does not fit the stored tensor")  # a caller's bug
    if record.transforms:
        got = _read_compressed(stream, path, item, record, layout, checksum, dest)
    else:
        got = _read_plain(stream, path, item, record.start, layout, checksum, dest, hash_pool)
    if isinstance(got, bool):
        return got
    if got != checksum:
        raise CheckpointCorruptError(
            path, "checksum mismatch", item=item, expected=checksum, actual=got
        )
    return True


def transient_bytes(layout: TensorLayout, record: ItemRecord) -> int:
    """The bytes :func:`read_tensor_item` allocates beyond ``dest`` for an item of ``layout``:
    a small item is read whole, a large one straight into ``dest`` around its prefix and
    suffix, a compressed one through zstd's window."""
    if record.transforms:
        return STREAM_BYTES
    if layout.length <= _WHOLE_MAX_BYTES:
        return layout.length
    return len(layout.prefix) + len(layout.suffix)


def _read_plain(
    stream: BinaryIO,
    path: str,
    item: str,
    start: int,
    layout: TensorLayout,
    checksum: str | None,
    dest: torch.Tensor,
    hash_pool: ThreadPoolExecutor | None,
) -> bool | str:
    """Read the uncompressed item at ``start``: its checksum, or whether it is ``layout``'s
    (``True`` unverified, ``False``: not)."""
    algorithm = None if checksum is None else checksum.partition(":")[0]
    hasher = None if algorithm is None else new_hasher(algorithm, size_hint=layout.length)
    stream.seek(start)
    if layout.length <= _WHOLE_MAX_BYTES:
        known = _read_whole(stream, path, item, layout, hasher, dest)
    else:
        known = _read_chunked(stream, path, item, layout, hasher, dest, hash_pool)
    if not known or algorithm is None or hasher is None:
        return known
    return format_checksum(algorithm, hasher)


def _read_whole(
    stream: BinaryIO,
    path: str,
    item: str,
    layout: TensorLayout,
    hasher: Hasher | None,
    dest: torch.Tensor,
) -> bool:
    buffer = bytearray(layout.length)
    view = memoryview(buffer)
    got = read_fully(stream, view)
    if got != layout.length:
        raise short_read(path, item, layout.length, got)
    if hasher is not None:
        hasher.update(view)
    head, end = len(layout.prefix), len(layout.prefix) + layout.payload
    if not layout.matches(view[:head], view[end:]):
        return False
    tensor_bytes(dest)[:] = view[head:end]
    return True


def _read_chunked(
    stream: BinaryIO,
    path: str,
    item: str,
    layout: TensorLayout,
    hasher: Hasher | None,
    dest: torch.Tensor,
    hash_pool: ThreadPoolExecutor | None,
) -> bool:
    prefix = bytearray(len(layout.prefix))
    got = read_fully(stream, memoryview(prefix))
    if got != len(prefix):
        raise short_read(path, item, layout.length, got)
    if bytes(prefix) != layout.prefix:
        return False
    if hasher is not None:
        hasher.update(prefix)
    target = tensor_bytes(dest)
    pending: Future[object] | None = None
    try:
        for at in range(0, layout.payload, _CHUNK_BYTES):
            chunk = target[at : at + _CHUNK_BYTES]
            got = read_fully(stream, chunk)
            if got != chunk.nbytes:
                raise short_read(path, item, layout.length, len(prefix) + at + got)
            if hasher is None:
                continue
            if pending is not None:
                pending.result()  # one hash in flight: updates must stay in file order
            if hash_pool is None:
                hasher.update(chunk)
            else:
                pending = hash_pool.submit(hasher.update, chunk)
    finally:
        if pending is not None:
            pending.result()
    suffix = bytearray(len(layout.suffix))
    got = read_fully(stream, memoryview(suffix))
    if got != len(suffix):
        raise short_read(path, item, layout.length, len(prefix) + layout.payload + got)
    if hasher is not None:
        hasher.update(suffix)
    return layout.matches(prefix, memoryview(suffix))


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


def _read_compressed(
    stream: BinaryIO,
    path: str,
    item: str,
    record: ItemRecord,
    layout: TensorLayout,
    checksum: str | None,
    dest: torch.Tensor,
) -> bool | str:
    """Decompress the zstd item into ``dest``: as :func:`_read_plain` answers."""
    source = (
        _Window(stream, record.start, record.length)
        if checksum is None
        else VerifyingSlice(stream, record.start, record.length, checksum)
    )
    try:
        known = _decompress(source, layout, dest)
    except zstandard.ZstdError:
        return False
    if not known or not isinstance(source, VerifyingSlice):
        return known
    actual, whole = source.finish()
    if not whole:
        raise CheckpointCorruptError(path, "file is shorter than the manifest says", item=item)
    return actual


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
