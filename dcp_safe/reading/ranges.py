"""Read only the blocks of a stored tensor that a load request needs, each block verified.

A resharded load asks for a region of a stored chunk (``ReadItem.storage_offsets`` and
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

Anything else is read whole, as before (:class:`~dcp_safe.adapters.reader.SafeStorageReader`):
items without block digests (compressed, small, non-tensor, written before them or with
``block_digests=False``), a region that is the whole chunk (read straight into its target),
regions of more than :data:`MAX_RUNS` runs, and regions whose blocks cover all of the item's
data anyway. A region that needs most but not all blocks is still read in blocks: fewer bytes,
and one buffer of at most 16 MiB where a whole read that is narrowed holds a transient copy of
the whole chunk.
"""

from __future__ import annotations

import itertools
import math
import mmap
from dataclasses import dataclass
from typing import BinaryIO

import torch
from torch.distributed.checkpoint.planner import ReadItem

from dcp_safe.adapters.tensor_records import layout_for, tensor_bytes
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.blocks import BlockDigests
from dcp_safe.manifest.checksum import digest_bytes
from dcp_safe.manifest.schema import ItemRecord
from dcp_safe.manifest.streams import check_digest, read_fully, short_read

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


def plan_blocks(
    path: str,
    item: str,
    record: ItemRecord,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    request: ReadItem,
) -> RangePlan | None:
    """The blocks of ``record`` (a tensor of ``dtype`` and ``shape``) that ``request``'s region
    needs, or ``None`` when it is better read whole or the item has no usable block digests.

    Raises:
        CheckpointCorruptError: the digests do not lie over the tensor data.
    """
    blocks = record.blocks
    if blocks is None or record.transforms:
        return None
    layout = layout_for(dtype, shape)
    if layout is None or layout.length != record.length:
        return None  # not the writer's template: the whole read's checksum decides
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
    return plan_range(blocks, shape, dtype.itemsize, request.storage_offsets, request.lengths)


def read_runs(
    stream: BinaryIO,
    path: str,
    item: str,
    record: ItemRecord,
    plan: RangePlan,
    algorithm: str | None,
    dest: torch.Tensor,
) -> int:
    """Read the plan's blocks of ``record``, piece by piece, verify each (``algorithm`` None:
    unchecked), copy the runs into ``dest`` (the region); the stored bytes read.

    Raises:
        CheckpointCorruptError: the file is short, or a block read differs from its digest
            (``dest`` may then be partly written, as in any failed DCP load).
    """
    blocks = record.blocks
    assert blocks is not None  # planned by plan_blocks
    out = tensor_bytes(dest)
    buffer = memoryview(mmap.mmap(-1, plan.buffer_bytes))  # pages go back when it is dropped
    read, run, written = 0, 0, 0
    for first, end in plan.spans:
        for piece in range(first, end, _PIECE_BLOCKS):
            last = min(piece + _PIECE_BLOCKS, end) - 1
            lo, hi = blocks.span(piece)[0], blocks.span(last)[1]
            view = buffer[: hi - lo]
            stream.seek(record.start + blocks.at + lo)
            got = read_fully(stream, view)
            if got != hi - lo:
                raise short_read(path, item, hi - lo, got)
            read += got
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
    return read
