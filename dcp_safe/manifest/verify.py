"""The one check of a stored file against its manifest record, as its bytes stream past.

Deep verification and replication's verified copy both use it, so they agree on what "intact"
means. Items are grouped by file once (:func:`items_by_file`), so checking a checkpoint is
linear in its files and items. (Loads verify one item at a time: :mod:`dcp_safe.manifest.streams`.)
"""

from __future__ import annotations

import bisect
import itertools
import math
from array import array
from collections.abc import Sequence
from typing import BinaryIO

from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.blocks import BlockHasher
from dcp_safe.manifest.checksum import Hasher, new_hasher
from dcp_safe.manifest.limits import TILE_MAX_CELLS
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest, RankManifest
from dcp_safe.manifest.streams import check_digest, short_read

DEFAULT_CHUNK_BYTES = 8 << 20


def check_stream(stream: BinaryIO, path: str, record: FileRecord, items: list[ItemRecord]) -> int:
    """Read ``stream`` to its recorded size through a :class:`FileCheck`; return bytes read.

    Raises:
        CheckpointCorruptError: short file, items that do not tile it, or a checksum mismatch.
    """
    check = FileCheck(path, record, items)
    remaining = record.size
    while remaining and (data := stream.read(min(DEFAULT_CHUNK_BYTES, remaining))):
        check.update(data)
        remaining -= len(data)
    check.finish()
    return record.size - remaining


def items_by_file(
    manifest_path: str, manifest: Manifest | RankManifest
) -> dict[str, list[ItemRecord]]:
    """Each file's items in order of ``start``; every file they name must be listed."""
    by_file: dict[str, list[ItemRecord]] = {}
    for item in manifest.items:
        by_file.setdefault(item.file, []).append(item)
    unlisted = sorted(set(by_file) - {f.path for f in manifest.files})
    if unlisted:
        raise CheckpointCorruptError(manifest_path, f"manifest does not list {', '.join(unlisted)}")
    return {path: sorted(items, key=lambda i: i.start) for path, items in by_file.items()}


class FileCheck:
    """Checks one file against its manifest record as its bytes stream past, chunk by chunk.

    A file with a whole-file checksum is hashed whole; a shard file's items must tile it
    exactly, in order of ``start``, and each item is hashed from its own byte range, so a
    flipped byte anywhere lands in some checksum. An item's block digests are checked too (in
    the same pass), so a partial read never trusts a digest that full verification did not.
    """

    def __init__(self, path: str, record: FileRecord, items: list[ItemRecord]) -> None:
        self._path, self._record, self._position = path, record, 0
        # A record's algorithm is a known one (the record was checked when it was made).
        self._whole = None if record.checksum is None else new_hasher(record.checksum.split(":")[0])
        ends = list(itertools.accumulate((item.length for item in items), initial=0))
        tiled = ends[-1] == record.size and [item.start for item in items] == ends[:-1]
        if (items or record.checksum is None) and not tiled:
            raise CheckpointCorruptError(path, "manifest items do not cover the file exactly")
        self._pending = iter(items)
        # The item being hashed, its hasher and its block hasher; None once none is left.
        self._item: tuple[ItemRecord, Hasher, BlockHasher | None] | None = None
        self._next_items()

    def update(self, data: bytes) -> None:
        if self._whole is not None:
            self._whole.update(data)
        view = memoryview(data)
        while view and self._item is not None:
            item, hasher, blocks = self._item
            take = min(len(view), item.start + item.length - self._position)
            hasher.update(view[:take])
            if blocks is not None:
                blocks.update(self._position, view[:take])
            self._position += take
            view = view[take:]
            self._next_items()
        self._position += len(view)

    def finish(self) -> None:
        """Raise unless every byte arrived and the whole-file checksum (if any) matches."""
        if self._position != self._record.size or self._item is not None:
            raise short_read(self._path, None, self._record.size, self._position)
        if self._whole is not None and self._record.checksum is not None:
            check_digest(self._path, None, self._record.checksum, self._whole)

    def _next_items(self) -> None:
        """Close every item that ends at the current position (zero-length ones included), and
        hash the next one from here on."""
        while self._item is None or self._item[0].start + self._item[0].length == self._position:
            if self._item is not None:
                item, hasher, blocks = self._item
                check_digest(self._path, item.describe(), item.checksum, hasher)
                if blocks is not None and item.blocks is not None:  # fed every byte of its range
                    algorithm, found = item.checksum.partition(":")[0], blocks.result().digests
                    for block, digest in enumerate(item.blocks.digests):
                        expected, actual = f"{algorithm}:{digest}", f"{algorithm}:{found[block]}"
                        check_digest(self._path, item.describe(), expected, actual, block=block)
            following = next(self._pending, None)
            if following is None:
                self._item = None
                return
            self._item = self._start(following)

    def _start(self, item: ItemRecord) -> tuple[ItemRecord, Hasher, BlockHasher | None]:
        """``item``'s hashers: of its bytes, and of its block digests' range (if it has any)."""
        algorithm = item.checksum.partition(":")[0]
        blocks = item.blocks
        if blocks is None:
            return item, new_hasher(algorithm), None
        if blocks.at + blocks.length > item.length:
            reason = "block digests reach past the item"
            raise CheckpointCorruptError(self._path, reason, item=item.describe())
        hasher = BlockHasher(algorithm, item.start, blocks.at, blocks.length, blocks.block_bytes)
        return item, new_hasher(algorithm), hasher


Box = tuple[Sequence[int], Sequence[int]]
"""A chunk of a tensor: its ``offsets`` and ``sizes``, one of each per dimension."""


def chunk_tiling_problem(shape: Sequence[int], chunks: Sequence[Box]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``shape`` exactly (no overlap, no gap), or None.

    Exact over the grid that the chunks' own boundaries cut the tensor into (each cell lies
    in a chunk whole or not at all), so it costs cells, not elements: one cell per chunk for
    DCP's row and grid shardings. Adding up element counts is not enough: two overlapping
    chunks can hide a gap of the same size. A grid over :data:`TILE_MAX_CELLS` is refused.
    """
    rank = len(shape)
    for offsets, sizes in chunks:
        if (
            len(offsets) != rank
            or len(sizes) != rank
            or not all(
                at >= 0 and size >= 0 and at + size <= dim
                for at, size, dim in zip(offsets, sizes, shape, strict=True)
            )
        ):
            return f"the chunk at {list(offsets)} of {list(sizes)} lies outside the tensor"
    if len(chunks) == 1 and tuple(chunks[0][1]) == tuple(shape):
        return None  # one chunk, the whole tensor: what an unsharded tensor is saved as
    # A trailing dimension of 1 gives a 0-d tensor a grid too.
    boxes = [((*o, 0), (*s, 1)) for o, s in chunks]
    cuts = [
        sorted({0, dim, *(b[0][d] for b in boxes), *(b[0][d] + b[1][d] for b in boxes)})
        for d, dim in enumerate((*shape, 1))
    ]
    cells = 1
    for cut in cuts:
        cells *= len(cut) - 1
        if cells > TILE_MAX_CELLS:
            return f"its {len(chunks)} chunks cut it into over {TILE_MAX_CELLS} pieces to check"
    strides = [math.prod(len(cut) - 1 for cut in cuts[d + 1 :]) for d in range(len(cuts))]
    owner = array("q", [-1]) * cells
    for index, (offsets, sizes) in enumerate(boxes):
        spans = [
            range(bisect.bisect_left(cut, at), bisect.bisect_left(cut, at + size))
            for cut, at, size in zip(cuts, offsets, sizes, strict=True)
        ]
        for corner in itertools.product(*spans[:-1]):
            base = sum(c * s for c, s in zip(corner, strides, strict=False))
            lo, hi = base + spans[-1].start, base + spans[-1].stop
            other = max(owner[lo:hi], default=-1)
            if other >= 0:
                return (
                    f"the chunks at {list(chunks[other][0])} and {list(chunks[index][0])} overlap"
                )
            owner[lo:hi] = array("q", [index]) * (hi - lo)
    if -1 in owner:
        cell = owner.index(-1)
        element = [
            cut[(cell // stride) % (len(cut) - 1)]
            for cut, stride in zip(cuts, strides, strict=True)
        ]
        return f"no chunk holds the element at {element[:-1]}"
    return None
