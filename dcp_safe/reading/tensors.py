"""Read a stored tensor item of a known layout straight into its destination, verified: whole,
or only the blocks of it a load request needs.

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

Blocks: a resharded load asks for a region of a stored chunk (``ReadItem.storage_offsets`` and
``lengths``): a tensor saved over 2 ranks and loaded over 4 needs half of each stored chunk.
Where the item records block digests (:mod:`dcp_safe.manifest.blocks`), the region's elements
lie in a few runs of the item's raw tensor data (one run for a slice along dim 0), so only the
blocks covering those runs are read, each checked against its digest before any of its bytes
is used, and the runs are copied into the destination. The item's whole checksum is not
checked: bytes outside the blocks read are never used, and a full verify
(:func:`~dcp_safe.verify_checkpoint`) still checks every byte. Where the data lies in the item
comes from the tensor's stored template (its dtype and shape), not from the manifest: digests
recorded over any other bytes (``blocks.at`` moved, digests recomputed: a deep verify and a
whole read still pass) are refused, by whole and partial loads alike.

Anything else is read whole: items without block digests (compressed, small, non-tensor,
written before them or with ``block_digests=False``), a region that is the whole chunk (read
straight into its target), regions of more than :data:`MAX_RUNS` runs, and regions whose
blocks cover all of the item's data anyway. A region that needs most but not all blocks is
still read in blocks: fewer bytes, and one buffer of at most 16 MiB where a whole read that is
narrowed holds a transient copy of the whole chunk.
"""

from __future__ import annotations

import io
import itertools
import math
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, BinaryIO, cast

import torch
import zstandard
from torch.distributed.checkpoint.planner import ReadItem

from dcp_safe.adapters.tensor_records import TensorLayout, layout_for, tensor_bytes
from dcp_safe.checkpoints.items import ZSTD_DESCRIPTOR
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.blocks import BlockDigests
from dcp_safe.manifest.checksum import digest_bytes, new_hasher
from dcp_safe.manifest.schema import ItemRecord
from dcp_safe.manifest.streams import check_digest, read_fully, short_read

# Items up to this size are read whole into memory in one call (one syscall, one hash call).
_WHOLE_MAX_BYTES = 1 << 20
# The payload of a large item is filled this many bytes at a time (read, or decompressed from a
# zstd item): big enough to amortise a call, small enough that hashing one overlaps reading the
# next.
_CHUNK_BYTES = 16 << 20
# zstd items: compressed bytes read at once.
_READ_BYTES = 256 << 10
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
    at = stream.tell()
    size = stream.seek(0, os.SEEK_END)  # no I/O: an fsspec file knows its size from its open
    stream.seek(at)
    if record.start + record.length > size:
        raise short_read(path, item, record.length, max(0, size - record.start))


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
    stream.seek(record.start)
    source = _Slice(stream, record.length, algorithm, hash_pool)
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
    """``length`` bytes of ``stream`` from where it is, read in order and hashed as read (with
    an ``algorithm``): a chunk larger than :data:`_WHOLE_MAX_BYTES` (only the payload's, which
    stay put in the destination) on ``pool`` while the next is read, one at a time so that the
    updates stay in file order."""

    def __init__(
        self, stream: BinaryIO, length: int, algorithm: str | None, pool: ThreadPoolExecutor | None
    ) -> None:
        super().__init__()
        self._stream, self.left, self.short, self._pool = stream, length, False, pool
        self.hasher = None if algorithm is None else new_hasher(algorithm, size_hint=length)
        self._pending: Future[object] | None = None

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
                return _read_layout(reader, layout, dest)
        except zstandard.ZstdError:
            return False
    if record.length <= _WHOLE_MAX_BYTES:  # one read and one hash call for a small item
        whole = memoryview(bytearray(record.length))
        head, end = len(layout.prefix), len(layout.prefix) + layout.payload
        if source.readinto(whole) < record.length or not layout.matches(whole[:head], whole[end:]):
            return False
        tensor_bytes(dest)[:] = whole[head:end]
        return True
    return _read_layout(source, layout, dest)


def _read_layout(reader: _Readable, layout: TensorLayout, dest: torch.Tensor) -> bool:
    """Fill ``dest`` with the payload ``reader`` yields, :data:`_CHUNK_BYTES` at a time; whether
    the bytes around it are exactly ``layout``'s."""
    prefix = bytearray(len(layout.prefix))
    if read_fully(reader, memoryview(prefix)) != len(prefix) or bytes(prefix) != layout.prefix:
        return False
    target = tensor_bytes(dest)
    for at in range(0, layout.payload, _CHUNK_BYTES):
        part = target[at : at + _CHUNK_BYTES]
        if read_fully(reader, part) != part.nbytes:
            return False
    suffix = bytearray(len(layout.suffix) + 1)  # one more: the item must end there
    got = read_fully(reader, memoryview(suffix))
    return got == len(layout.suffix) and layout.matches(prefix, memoryview(suffix)[:got])


#: Regions of more separate runs than this are read whole (a slice along a later dim of a
#: large tensor: every block is likely touched anyway, and planning would cost per run).
MAX_RUNS = 1024
# Blocks read with one call (into one buffer): bounds what a partial read holds.
_PIECE_BLOCKS = 4


@dataclass(frozen=True)
class RangePlan:
    """What to read for one request: the region's ``runs`` in the tensor's data, ``(start,
    nbytes)`` in its C order (concatenated, the region's bytes); the ``spans`` of blocks to read,
    ``[first, end)``, ascending and coalesced; the ``read_bytes`` they cover; the largest piece
    read at once, ``buffer_bytes`` (what the read holds beyond its target)."""

    runs: tuple[tuple[int, int], ...]
    spans: tuple[tuple[int, int], ...]
    read_bytes: int
    buffer_bytes: int


def plan_range(
    blocks: BlockDigests,
    shape: tuple[int, ...],
    itemsize: int,
    offsets: tuple[int, ...] | list[int] | torch.Size,
    lengths: tuple[int, ...] | list[int] | torch.Size,
) -> RangePlan | None:
    """The blocks of the region ``offsets``/``lengths`` of a stored C-contiguous tensor of
    ``shape``, or ``None`` when it is better read whole (see the module docstring)."""
    offsets, lengths = tuple(offsets), tuple(lengths)
    if not shape or len(offsets) != len(shape) or len(lengths) != len(shape) or 0 in lengths:
        return None
    inner = len(shape) - 1  # the innermost dim the region does not cover whole
    while inner >= 0 and offsets[inner] == 0 and lengths[inner] == shape[inner]:
        inner -= 1
    if inner < 0 or math.prod(lengths[:inner]) > MAX_RUNS:
        return None
    strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape))]
    run_bytes = lengths[inner] * strides[inner]
    outer = itertools.product(
        *(range(o, o + n) for o, n in zip(offsets[:inner], lengths[:inner], strict=True))
    )
    base = offsets[inner] * strides[inner]
    runs = tuple(
        (base + sum(i * s for i, s in zip(index, strides, strict=False)), run_bytes)
        for index in outer
    )
    spans: list[tuple[int, int]] = []
    for start, nbytes in runs:
        first, end = start // blocks.block_bytes, (start + nbytes - 1) // blocks.block_bytes + 1
        if spans and first <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((first, end))
    covered = [blocks.span(end - 1)[1] - blocks.span(first)[0] for first, end in spans]
    if sum(covered) >= blocks.length:
        return None  # every block: nothing saved
    piece = min(max(covered), _PIECE_BLOCKS * blocks.block_bytes)
    return RangePlan(runs, tuple(spans), sum(covered), piece)


def plan_tensor_read(
    path: str,
    item: str,
    record: ItemRecord,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    request: ReadItem,
) -> tuple[TensorLayout, RangePlan | None] | None:
    """How to read ``record`` (a tensor of ``dtype`` and ``shape``) without ``torch.load``: its
    layout, and the blocks ``request``'s region needs (``None``: read it whole, an uncompressed
    one of the layout's length or a zstd one, checked as it decompresses); ``None``: another
    item, decoded whole.

    Raises:
        CheckpointCorruptError: the block digests do not lie over the tensor data.
    """
    layout = layout_for(dtype, shape)
    if layout is None or record.transforms not in ((), (ZSTD_DESCRIPTOR,)):
        return None
    if record.transforms:
        return layout, None
    if layout.length != record.length:
        return None  # not the writer's template: the whole read's checksum decides
    blocks = record.blocks
    if blocks is None:
        return layout, None
    placed = (len(layout.prefix), layout.payload)
    if (blocks.at, blocks.length) != placed:
        # Digests over any other bytes of the item would pass a deep verify and the whole
        # read's checksum, and hand this read the wrong elements: where the data lies is
        # the template's, never the manifest's word.
        raise CheckpointCorruptError(
            path,
            "block digests do not lie over the tensor data",
            item=item,
            expected=f"at {placed[0]}, {placed[1]} bytes",
            actual=f"at {blocks.at}, {blocks.length} bytes",
        )
    return layout, plan_range(
        blocks, shape, dtype.itemsize, request.storage_offsets, request.lengths
    )


def read_runs(
    stream: BinaryIO,
    path: str,
    item: str,
    record: ItemRecord,
    plan: RangePlan,
    algorithm: str | None,
    dest: torch.Tensor,
) -> None:
    """Read the plan's blocks of ``record``, piece by piece, verify each (``algorithm`` None:
    unchecked), copy the runs into ``dest`` (the region): ``plan.read_bytes`` stored bytes (the
    pieces cover the spans' blocks exactly, each read whole).

    Raises:
        CheckpointCorruptError: the file is short, or a block read differs from its digest
            (``dest`` may then be partly written, as in any failed DCP load).
    """
    blocks = record.blocks
    assert blocks is not None  # planned by plan_tensor_read
    out = tensor_bytes(dest)
    buffer = memoryview(mmap.mmap(-1, plan.buffer_bytes))  # pages go back when it is dropped
    run = written = 0
    for first, end in plan.spans:
        for piece in range(first, end, _PIECE_BLOCKS):
            last = min(piece + _PIECE_BLOCKS, end) - 1
            lo, hi = blocks.span(piece)[0], blocks.span(last)[1]
            view = buffer[: hi - lo]
            stream.seek(record.start + blocks.at + lo)
            got = read_fully(stream, view)
            if got != hi - lo:
                raise short_read(path, item, hi - lo, got)
            if algorithm is not None:
                for block in range(piece, last + 1):
                    block_lo, block_hi = blocks.span(block)  # not ``end``: the span's
                    actual = digest_bytes(view[block_lo - lo : block_hi - lo], algorithm)
                    expected = f"{algorithm}:{blocks.digests[block]}"
                    check_digest(path, item, expected, actual, block=block)
            for start, nbytes in plan.runs[run:]:
                if start >= hi:
                    break
                begin, stop = max(start, lo), min(start + nbytes, hi)
                at = written + begin - start
                out[at : at + stop - begin] = view[begin - lo : stop - lo]
                if stop == start + nbytes:
                    written, run = written + nbytes, run + 1
