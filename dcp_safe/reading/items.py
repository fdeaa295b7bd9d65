"""``ItemReader``: one stored item, read, verified, decoded and handed to DCP's planner.

Whatever the source (the remote, this node's cache, a peer copy), an item is read the same way:
only the blocks a request needs where the item has block digests, a plain tensor straight into
its destination (both :mod:`.tensors`), anything else read whole, decoded and narrowed. Every
read is admitted against the load budget at a cost stated before it is made (:mod:`.budget`).
The sources differ only in what a failure means: the remote retries a transient error on a fresh
stream and raises the rest; a partial copy's failure is :class:`CopyFailed`, and the next source
decides (:class:`~dcp_safe.adapters.reader.SafeStorageReader`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_safe.backends.retry import is_transient
from dcp_safe.checkpoints.items import (
    OBJECT_MAX_DECODED_BYTES,
    decode_tensor_item,
    decode_transforms,
    sanitized_object_stream,
    tensor_item_bound,
)
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.schema import ItemKey, ItemRecord
from dcp_safe.manifest.streams import read_verified
from dcp_safe.reading.budget import LoadBudget
from dcp_safe.reading.tensors import (
    plan_tensor_read,
    read_runs,
    read_tensor_item,
    require_stored,
    transient_bytes,
    transient_tensor,
)
from dcp_safe.torch_compat import narrow_tensor_by_index

# The stated cost of an item whose decoded size nothing bounds (a compressed object from a
# root trusted with pickles): more than any budget, so it is admitted alone.
_UNBOUNDED_BYTES = 1 << 62


class CopyFailed(Exception):
    """Reading an item from a partial copy failed (not handing it over: that would fail from
    the remote too, and is raised as it is)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class ItemReader:
    """Reads items for one reader: ``lock`` guards its planner and counters (files are read on
    several threads), ``budget`` bounds its transient memory. ``bytes_read`` and ``items_read``:
    the reader's (``SafeStorageReader.bytes_read``); ``hash_pool``: set by the reader while it
    reads, hashes a large item's chunk while the next is read."""

    def __init__(
        self, lock: threading.RLock, budget: LoadBudget, *, verify: bool, allow_pickle: bool
    ) -> None:
        self.lock, self.budget = lock, budget
        self.verify, self.allow_pickle = verify, allow_pickle
        self.stored: dict[ItemKey, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.hash_pool: ThreadPoolExecutor | None = None
        self.bytes_read = self.items_read = 0

    def reset(self, stored: dict[ItemKey, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """A new checkpoint: its stored tensors' dtypes and shapes; the counters start over."""
        self.stored = stored
        self.bytes_read = self.items_read = 0
        self.budget.reset_stats()

    def load(
        self,
        stream: Any,
        path: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
        *,
        again: Callable[[], bytearray] | None = None,
    ) -> None:
        """Load one item from ``stream``: the remote's with ``again`` (the item's stored bytes
        read on a fresh stream, within the retry policy, after a transient error), else a
        partial copy's, its checksum checked whatever ``verify`` says.

        Raises:
            CheckpointCorruptError: (the remote) the item is short or its checksum differs.
            CopyFailed: (a copy) reading it failed; an error while handing a verified item
                over would be the remote's too, and is raised as it is.
        """
        verify = self.verify if again is not None else True
        item = _Item(path, label, record, request, planner)

        def read() -> bytearray:
            try:
                return self.read_raw(stream, path, label, record, verify=verify)
            except Exception as exc:
                return _retry(exc, again)()

        if request.type != LoadItemType.BYTE_IO:
            try:
                if self._load_known(stream, item, verify):
                    return
            except Exception as exc:
                read = _retry(exc, again)
        self._load_whole(item, read)

    def load_bytes(
        self,
        read: Callable[[], bytearray],
        path: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
    ) -> None:
        self._load_whole(_Item(path, label, record, request, planner), read)

    def read_raw(
        self, stream: Any, path: str, label: str, record: ItemRecord, *, verify: bool | None = None
    ) -> bytearray:
        """One item's stored bytes, checked as ``verify`` says (default: the reader's); a
        tensor decoded from them shares their memory."""
        verify = self.verify if verify is None else verify
        require_stored(stream, path, label, record)
        checksum = record.checksum if verify else None
        return read_verified(stream, path, label, record.start, record.length, checksum)

    def _load_whole(self, item: _Item, read: Callable[[], bytearray]) -> None:
        """Admit the item at the most transient bytes reading it whole and delivering it holds
        (its stored bytes, what they decompress to and, for an object, its re-serialized
        copy), ``read`` it, decode it and hand it over."""
        record, path, label = item.record, item.path, item.label
        objects = item.request.type == LoadItemType.BYTE_IO
        stored = None if objects else self.stored.get(record.key)
        bound: int | None
        if objects:  # bounded unless the caller trusts the root (then as it decompresses)
            bound = None if self.allow_pickle else max(OBJECT_MAX_DECODED_BYTES, record.length)
            decoded = bound if record.transforms else record.length
            cost = _UNBOUNDED_BYTES if decoded is None else record.length + 2 * decoded
        else:
            bound = None if stored is None else tensor_item_bound(*stored)
            cost = record.length + (bound if record.transforms and bound else 0)
        with self.budget.admit(cost) as held:
            raw = read()
            held.count(len(raw))
            if not objects and stored is None:
                raise CheckpointCorruptError(
                    path, "no tensor of the metadata lies here", item=label
                )
            data = decode_transforms(raw, record.transforms, max_bytes=bound, path=path, item=label)
            if data is not raw:
                held.count(len(data))  # decompressed; the value is decoded over it
            if stored is None:
                safe = sanitized_object_stream(data, path, label, allow_pickle=self.allow_pickle)
                with safe.getbuffer() as copy:
                    held.count(copy.nbytes)
                with self.lock:
                    item.planner.load_bytes(item.request, safe)
                return
            dtype, shape = stored
            tensor = decode_tensor_item(data, dtype=dtype, shape=shape, path=path, item=label)
            with self.lock:
                target = item.planner.resolve_tensor(item.request).detach()
            self._hand_over(_narrowed(tensor, item.request), item, target)

    def _load_known(self, stream: Any, item: _Item, verify: bool) -> bool:
        """Read a plain-tensor item (zstd too) without ``torch.load``: only the blocks the
        request needs where the item has block digests (:mod:`dcp_safe.reading.tensors`), else
        the whole stored tensor; straight into the request's target where that takes the bytes
        as read, else into a transient tensor (narrowed to the request when the whole was
        read), and hand it over. ``False``: not such an item, nothing handed over."""
        record, request = item.record, item.request
        stored = self.stored.get(record.key)
        if stored is None:
            return False
        require_stored(stream, item.path, item.label, record)
        dtype, shape = stored
        checksum = record.checksum if verify else None
        how = plan_tensor_read(item.path, item.label, record, dtype, shape, request)
        if how is None:
            return False
        layout, plan = how
        if plan is not None:
            shape, buffer_bytes, narrow = tuple(request.lengths), plan.buffer_bytes, False
        else:
            buffer_bytes = transient_bytes(layout, record)
            narrow = any(request.storage_offsets) or tuple(request.lengths) != shape
        with self.lock:
            target = item.planner.resolve_tensor(request).detach()
        direct = (
            not narrow
            and target.device.type == "cpu"
            and target.dtype == dtype
            and tuple(target.shape) == shape
            and target.is_contiguous()
        )
        # What is allocated is known exactly: the read's own buffers and, unless the target
        # takes the bytes directly, a tensor of the shape read.
        cost = buffer_bytes + (0 if direct else math.prod(shape) * dtype.itemsize)
        with self.budget.admit(cost) as held:
            held.count(cost)
            dest = target if direct else transient_tensor(shape, dtype)
            if plan is None:
                args = (item.path, item.label, record, layout, checksum, dest, self.hash_pool)
                if not read_tensor_item(stream, *args):
                    return False
            else:
                algorithm = None if checksum is None else checksum.partition(":")[0]
                read_runs(stream, item.path, item.label, record, plan, algorithm, dest)
                with self.lock:  # counted whole by the reader
                    self.bytes_read -= record.length - plan.read_bytes
            self._hand_over(_narrowed(dest, request) if narrow else dest, item, target)
        return True

    def _hand_over(self, tensor: torch.Tensor, item: _Item, target: torch.Tensor) -> None:
        """Copy ``tensor`` (the request's region) into ``target`` (the planner's, resolved) and
        commit it (CheckpointCorruptError: the region's shape is not the target's)."""
        if target.size() != tensor.size():
            raise CheckpointCorruptError(
                item.path,
                "stored tensor has another shape",
                item=item.label,
                expected=tuple(target.size()),
                actual=tuple(tensor.size()),
            )
        if target.data_ptr() != tensor.data_ptr() or target.device != tensor.device:
            target.copy_(tensor)
        with self.lock:
            item.planner.commit_tensor(item.request, target)


@dataclass(frozen=True)
class _Item:
    """One request being served: its stored record, where it lies (for errors), its planner."""

    path: str
    label: str
    record: ItemRecord
    request: ReadItem
    planner: LoadPlanner


def _narrowed(tensor: torch.Tensor, request: ReadItem) -> torch.Tensor:
    return narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)


def _retry(exc: Exception, again: Callable[[], bytearray] | None) -> Callable[[], bytearray]:
    """Raise what failing to read an item means, or return ``again``: the remote reads it again
    on a fresh stream after a transient error."""
    if again is None:
        raise CopyFailed(exc) from exc
    if isinstance(exc, CheckpointCorruptError) or not is_transient(exc):
        raise exc
    return again
