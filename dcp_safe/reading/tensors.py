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
from dcp_safe.manifest.checksum import new_hasher
from dcp_safe.manifest.schema import ItemRecord
from dcp_safe.manifest.streams import check_digest, read_fully, short_read

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

# What the payload is read from: the item's slice, or zstd's reader over it.
_Readable = io.RawIOBase | zstandard.ZstdDecompressionReader


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
    try:
        size: int | None = os.fstat(stream.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last
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
    algorithm = None if checksum is None else checksum.partition(":")[0]
    source = _Slice(stream, record.start, record.length, algorithm, hash_pool)
    try:
        known = _read_parts(source, record, layout, dest)
        if known and checksum is not None:
            source.finish()
    finally:
        source.wait()
    if source.short:
        raise short_read(path, item, record.length, record.length - source.left)
    if known and checksum is not None and source.hasher is not None:
        check_digest(path, item, checksum, source.hasher)
    return known


def transient_bytes(layout: TensorLayout, record: ItemRecord) -> int:
    """The bytes :func:`read_tensor_item` allocates beyond ``dest`` for an item of ``layout``:
    a small item is read whole, a large one straight into ``dest`` around its prefix and
    suffix, a compressed one through zstd's window."""
    if record.transforms:
        return STREAM_BYTES
    if layout.length <= _WHOLE_MAX_BYTES:
        return layout.length
    return len(layout.prefix) + len(layout.suffix)


class _Slice(io.RawIOBase):
    """``[start, start + length)`` of ``stream``, read in order and hashed as read (with an
    ``algorithm``): a chunk larger than :data:`_WHOLE_MAX_BYTES` (only the payload's, which
    stay put in the destination) on ``hash_pool`` while the next is read, one at a time so
    that the updates stay in file order."""

    def __init__(
        self,
        stream: BinaryIO,
        start: int,
        length: int,
        algorithm: str | None,
        hash_pool: ThreadPoolExecutor | None,
    ) -> None:
        super().__init__()
        self._stream, self.left, self.short = stream, length, False
        self.hasher = None if algorithm is None else new_hasher(algorithm, size_hint=length)
        self._pool = hash_pool
        self._pending: Future[object] | None = None
        stream.seek(start)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")[: self.left]
        got = read_fully(self._stream, view)
        self.left -= got
        self.short |= got < view.nbytes
        if self.hasher is not None and got:
            self.wait()
            if self._pool is None or got <= _WHOLE_MAX_BYTES:
                self.hasher.update(view[:got])
            else:
                self._pending = self._pool.submit(self.hasher.update, view[:got])
        return got

    def wait(self) -> None:
        """Until the hash in flight is done."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def finish(self) -> None:
        """Read and hash what is left (what a decompressor did not need): the checksum is of
        the whole stored item."""
        rest = bytearray(min(self.left, _READ_BYTES))
        while self.left and not self.short:
            self.readinto(rest)


def _read_parts(
    source: _Slice, record: ItemRecord, layout: TensorLayout, dest: torch.Tensor
) -> bool:
    """Read the item into ``dest``, through zstd for a compressed one; whether the bytes around
    its payload are ``layout``'s (a zstd frame that needs a larger window: ``False``)."""
    if record.transforms:
        decompressor = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW_BYTES)
        try:
            with decompressor.stream_reader(
                cast(IO[bytes], source), read_size=_READ_BYTES
            ) as reader:
                return _read_layout(reader, layout, dest, _OUT_BYTES)
        except zstandard.ZstdError:
            return False
    if record.length <= _WHOLE_MAX_BYTES:  # one read and one hash call for a small item
        whole = memoryview(bytearray(record.length))
        head, end = len(layout.prefix), len(layout.prefix) + layout.payload
        if source.readinto(whole) < record.length or not layout.matches(whole[:head], whole[end:]):
            return False
        tensor_bytes(dest)[:] = whole[head:end]
        return True
    return _read_layout(source, layout, dest, _CHUNK_BYTES)


def _read_layout(reader: _Readable, layout: TensorLayout, dest: torch.Tensor, chunk: int) -> bool:
    """Fill ``dest`` with the payload ``reader`` yields, ``chunk`` bytes at a time; whether the
    bytes around it are exactly ``layout``'s."""
    prefix = bytearray(len(layout.prefix))
    if read_fully(reader, memoryview(prefix)) != len(prefix) or bytes(prefix) != layout.prefix:
        return False
    target = tensor_bytes(dest)
    for at in range(0, layout.payload, chunk):
        part = target[at : at + chunk]
        if read_fully(reader, part) != part.nbytes:
            return False
    suffix = bytearray(len(layout.suffix) + 1)  # one more: the item must end there
    got = read_fully(reader, memoryview(suffix))
    return got == len(layout.suffix) and layout.matches(prefix, memoryview(suffix)[:got])
