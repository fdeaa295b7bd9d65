"""Read a stored tensor item of a known layout straight into its destination, verified.

The bytes go from the file into the destination with one copy while the whole item is hashed in
file order; large items in chunks, each hashed on a helper thread while the next is read, so
verification costs about max(read, hash). The destination is written before the checksum is
compared: a mismatch raises and leaves the state dict partly written, as any failed DCP load
does, but nothing reaches the planner unchecked.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import torch

from dcp_safe.dcp.tensor_records import TensorLayout, tensor_bytes
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.checksum import Hasher, format_checksum, new_hasher
from dcp_safe.manifest.streams import read_fully, short_read

__all__ = ["read_known_tensor", "transient_bytes"]

# Items up to this size are read whole into memory in one call (one syscall, one hash call).
_WHOLE_MAX_BYTES = 1 << 20
# Chunks of large items: big enough to amortise a call, small enough that hashing one overlaps
# reading the next.
_CHUNK_BYTES = 16 << 20


def transient_bytes(layout: TensorLayout) -> int:
    """The bytes :func:`read_known_tensor` allocates beyond ``dest`` for an item of ``layout``:
    a small item is read whole, a large one straight into ``dest`` around its prefix and
    suffix."""
    if layout.length <= _WHOLE_MAX_BYTES:
        return layout.length
    return len(layout.prefix) + len(layout.suffix)


def read_known_tensor(
    stream: BinaryIO,
    *,
    path: str,
    item: str,
    start: int,
    layout: TensorLayout,
    checksum: str | None,
    dest: torch.Tensor,
    hash_pool: ThreadPoolExecutor | None = None,
) -> bool:
    """Read the item at ``start`` into ``dest`` (a contiguous CPU tensor of the layout's size).

    ``checksum`` ``None`` reads without verifying. Returns ``False``, with ``dest`` undefined
    and nothing verified, when the bytes around the payload are not ``layout``'s (the caller
    falls back to ``torch.load``).

    Raises:
        CheckpointCorruptError: the file is short, or the checksum differs.
    """
    if dest.numel() * dest.element_size() != layout.payload or not dest.is_contiguous():
        raise ValueError("destination does not fit the stored tensor")  # a caller's bug
    algorithm = None if checksum is None else checksum.partition(":")[0]
    hasher = None if algorithm is None else new_hasher(algorithm, size_hint=layout.length)
    stream.seek(start)
    if layout.length <= _WHOLE_MAX_BYTES:
        known = _read_whole(stream, path, item, layout, hasher, dest)
    else:
        known = _read_chunked(stream, path, item, layout, hasher, dest, hash_pool)
    if not known or algorithm is None or hasher is None:
        return known
    actual = format_checksum(algorithm, hasher)
    if actual != checksum:
        raise CheckpointCorruptError(
            path, "checksum mismatch", item=item, expected=checksum, actual=actual
        )
    return True


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
