"""``SafeStorageReader``: DCP's ``StorageReader`` that loads only committed, verified bytes.

DCP calls a reader in this order (every rank)::

    reset(checkpoint_id)            resolve the name or "latest"; check marker, manifest and
                                    DCP metadata here (typed errors before DCP plans)
    read_metadata()                 DCP's metadata from the manifest's plain form
    set_up_storage_reader(metadata, is_coordinator, rank=...)
    prepare_local_plan / prepare_global_plan
    read_data(plan, planner)        every item checked against the manifest before the planner
                                    gets it

Checks run in ``reset`` because DCP turns an exception from ``read_metadata`` into a warning
and an ``AssertionError`` (docs/architecture.md, "Reads").
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.retry import RetryPolicy, call_with_retries, is_transient
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed, resolve_name
from dcp_safe.checkpoints.items import (
    OBJECT_MAX_DECODED_BYTES,
    decode_tensor_item,
    decode_transforms,
    read_item,
    stored_tensors,
    tensor_item_bound,
)
from dcp_safe.checkpoints.metadata import read_dcp_metadata
from dcp_safe.checkpoints.restricted import sanitized_object_stream
from dcp_safe.checkpoints.signed import check_signed, signed_by
from dcp_safe.dcp.load_budget import Admission, LoadBudget, LoadMemoryStats
from dcp_safe.dcp.range_reads import RangeReads, commit_into
from dcp_safe.dcp.tensor_reads import (
    known_layout,
    read_tensor_item,
    require_stored,
    transient_bytes,
    transient_tensor,
)
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DcpSafeError,
)
from dcp_safe.manifest.schema import ItemKey, ItemRecord, Manifest, item_key
from dcp_safe.manifest.signing import resolve_key
from dcp_safe.manifest.streams import read_verified
from dcp_safe.torch_compat import narrow_tensor_by_index

__all__ = ["SafeStorageReader"]

# The stated cost of an item whose decoded size nothing bounds (a compressed object from a
# root trusted with pickles): more than any budget, so it is admitted alone.
_UNBOUNDED_BYTES = 1 << 62


class SafeStorageReader(StorageReader):
    """Load committed checkpoints from ``root``, verifying every byte it uses.

    Args:
        verify: check item checksums while reading (the marker, manifest and ``.metadata``
            are always checked).
        checkpoint_id: the default checkpoint when ``dcp.load`` is given none; ``"latest"``.
        allow_pickle: trust this root as you trust code: items are unpickled without
            restriction and an old checkpoint's ``.metadata`` pickle is read. By default only
            plain data and the items' own tensors are decoded; anything else raises
            :class:`~dcp_safe.errors.UnsafeCheckpointError` (docs/integrity.md).
        signing_key: accept only checkpoints signed with this key (default
            ``$DCP_SAFE_SIGNING_KEY``); ``reset`` raises otherwise (see its Raises). Without a
            key, signed checkpoints load like any other.
        thread_count: files read at once (default: up to 4, at most the CPUs); the planner is
            called from one thread at a time.
        load_budget_bytes: the most transient host bytes the reads hold at once beyond the
            target state: an item's stored bytes read before they are copied into its tensor,
            its decompressed copy, a tensor built to be narrowed or copied to another device
            (plain CPU tensors loaded whole are read straight into the target and hold almost
            nothing). Each item is admitted, in arrival order, at a cost stated before it is
            read; one that costs more than the whole budget is admitted alone, so a small
            budget (even 1) slows a load down but never deadlocks it, and that item's bytes
            are then the bound. ``None`` (the default): no bound. What was held:
            :meth:`memory_stats`.

    Raises:
        ConfigError: ``verify=False`` with a signing key (unverified bytes prove nothing), a
            bad key, ``thread_count`` below 1, or ``load_budget_bytes`` not a positive int.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        checkpoint_id: str = layout.LATEST,
        fallback: str | os.PathLike[str] | None = None,
        fallback_storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        allow_pickle: bool = False,
        signing_key: bytes | str | None = None,
        thread_count: int | None = None,
        load_budget_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self._budget = LoadBudget(load_budget_bytes)
        self.load_budget_bytes = self._budget.budget_bytes
        if thread_count is not None and (
            not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1
        ):
            raise ConfigError(f"thread_count must be an int >= 1, got {thread_count!r}")
        self.thread_count = thread_count or max(1, min(4, os.cpu_count() or 1))
        self.allow_pickle = allow_pickle
        self._signing_key = resolve_key(signing_key)
        if self._signing_key is not None and not verify:
            raise ConfigError(
                "verify=False with a signing key: the signature vouches for the item checksums,"
                " so unverified items would load unauthenticated; drop one of the two"
            )
        self.root = os.fspath(root)
        self.verify = verify
        self.storage_options = storage_options
        self.retry = retry or RetryPolicy()
        self.backend: Backend = open_backend(self.root, storage_options, retry=retry)
        self.fallback: Backend | None = (
            None
            if fallback is None
            else open_backend(
                os.fspath(fallback), fallback_storage_options or storage_options, retry=retry
            )
        )
        self._requested = checkpoint_id
        self._name: str | None = None
        self._manifest: Manifest | None = None
        self._metadata: Metadata | None = None
        self._source: Backend = self.backend
        self._spare: Backend | None = None
        self._spare_checked = False
        self.items_from_fallback = 0
        #: Stored bytes and items this reader was asked to read since ``reset`` (each item's
        #: stored length once, or the blocks of it a partial read used; whatever tier served it;
        #: a retry is not counted again).
        self.bytes_read = 0
        self.items_read = 0
        # Files are read on several threads; the planner, the spare tier and the counters are
        # shared between them.
        self._lock = threading.RLock()
        self._ranges = RangeReads(self._lock, self._budget)
        self._stored: dict[ItemKey, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._hash_pool: ThreadPoolExecutor | None = None

    @property
    def checkpoint_id(self) -> str | None:
        """The resolved name of the checkpoint being read (after ``reset``)."""
        return self._name

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Resolve and open the checkpoint.

        Raises:
            InvalidCheckpointNameError: a malformed name.
            CheckpointNotFoundError: no committed checkpoint by that name (or none at all).
            CheckpointCorruptError: the marker, manifest or ``.metadata`` do not agree.
            SignatureError: with a signing key, the checkpoint is not signed with it
                (``UnsignedCheckpointError``: not signed at all).
        """
        if checkpoint_id is not None:
            self._requested = os.fspath(checkpoint_id)
        tiers = [self.backend] if self.fallback is None else [self.backend, self.fallback]
        opened: list[tuple[tuple[int, int, float], Backend, str, Manifest, Metadata]] = []
        failures: list[DcpSafeError] = []
        accept = None if self._signing_key is None else signed_by(self._signing_key)
        for order, backend in enumerate(tiers):
            try:
                name = resolve_name(backend, self._requested, accept=accept)
                committed = open_committed(backend, name)
                manifest = committed.manifest
                if self._signing_key is not None:
                    check_signed(backend, committed, self._signing_key)
                metadata = read_dcp_metadata(
                    backend, name, manifest, allow_pickle=self.allow_pickle
                )
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
            except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                failures.append(exc)
                continue
            # Newest by step; on the same step the local tier wins, whatever the clocks say, so a
            # replica (or something planted there) is used only when it is ahead by step.
            step = -1 if manifest.step is None else manifest.step
            opened.append(((step, -order, manifest.created_at), backend, name, manifest, metadata))
            if self._requested != layout.LATEST:
                break  # a named checkpoint: the first tier that has it, local first
        if not opened:
            raise failures[0]
        _, self._source, self._name, self._manifest, self._metadata = max(
            opened, key=lambda entry: entry[0]
        )
        self._spare, self._spare_checked = None, False
        self.items_from_fallback = 0
        self.bytes_read = self.items_read = 0
        self._stored = stored_tensors(self._metadata)
        self._budget.reset_stats()

    def memory_stats(self) -> LoadMemoryStats:
        """Transient host memory the reads held since the last ``reset`` (this rank)."""
        return self._budget.stats()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self.reset()
        assert self._metadata is not None
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None:
            raise ConfigError("SafeStorageReader used before reset()")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and hand over every item of ``plan``, one file at a time in file order.

        Raises:
            CheckpointCorruptError: a file is missing or short, or an item's checksum differs.
        """
        assert self._name is not None and self._metadata is not None
        storage = self._metadata.storage_data
        by_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            by_file.setdefault(storage[request.storage_index].relative_path, []).append(request)
        with self._lock:
            self.items_read += len(plan.items)
            self.bytes_read += sum(storage[r.storage_index].length for r in plan.items)
        for requests in by_file.values():
            requests.sort(key=lambda r: storage[r.storage_index].offset)
        workers = min(self.thread_count, len(by_file))
        # One helper thread per reader thread hashes a large item's chunk while the next is read.
        with ThreadPoolExecutor(
            max_workers=max(1, workers), thread_name_prefix="dcp_safe-hash"
        ) as hashing:
            self._hash_pool = hashing if self.verify else None
            try:
                if workers <= 1:
                    for file_name, requests in by_file.items():
                        self._read_file(file_name, requests, planner)
                else:
                    with ThreadPoolExecutor(workers, thread_name_prefix="dcp_safe-read") as pool:
                        reads = [
                            pool.submit(self._read_file, file_name, requests, planner)
                            for file_name, requests in by_file.items()
                        ]
                        for read in reads:  # the first failure, in file order, is raised
                            read.result()
            finally:
                self._hash_pool = None
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        checkpoint_id = os.fspath(checkpoint_id)
        return checkpoint_id == layout.LATEST or layout.is_valid_name(checkpoint_id)

    # ----------------------------------------------------------------- helpers

    def _read_file(self, file_name: str, requests: list[ReadItem], planner: LoadPlanner) -> None:
        assert self._name is not None
        rel = f"{self._name}/{file_name}"
        path = self._source.full_path(rel)
        try:
            with self._source.open_read(rel) as stream:
                for request in requests:
                    label, record = self._record_for(path, request)
                    try:
                        self._load_item(rel, stream, label, record, request, planner)
                    except CheckpointCorruptError as exc:
                        self._load_from_spare(rel, label, record, request, planner, cause=exc)
        except FileNotFoundError:
            spare = self._spare_tier()
            if spare is None:
                raise CheckpointCorruptError(path, "file is missing") from None
            for request in requests:
                label, record = self._record_for(path, request)
                self._load_from_spare(rel, label, record, request, planner, cause=None)

    def _record_for(self, path: str, request: ReadItem) -> tuple[str, ItemRecord]:
        assert self._manifest is not None and self._metadata is not None
        index = request.storage_index
        info = self._metadata.storage_data[index]
        record = self._manifest.item(item_key(index.fqn, index.offset))
        label = index.fqn if index.offset is None else f"{index.fqn}@{list(index.offset)}"
        if record is None or (record.start, record.length) != (info.offset, info.length):
            raise CheckpointCorruptError(path, "item is not in the manifest", item=label)
        return label, record

    def _read_raw(
        self, stream: Any, path: str, label: str, record: ItemRecord, *, verify: bool | None = None
    ) -> bytes:
        """One item's bytes; ``verify`` overrides the reader's setting (a node cache is always
        verified)."""
        verify = self.verify if verify is None else verify
        require_stored(stream, path, label, record)
        return read_verified(
            stream,
            path=path,
            item=label,
            start=record.start,
            length=record.length,
            checksum=record.checksum if verify else None,
        )

    def _load_item(
        self,
        rel: str,
        stream: Any,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
    ) -> None:
        path = self._source.full_path(rel)
        if request.type != LoadItemType.BYTE_IO and self._try_streamed(
            stream, path, label, record, request, planner
        ):
            return
        with self._budget.admit(self._raw_cost(record, request)) as held:
            raw = self._read_raw_retrying(rel, stream, label, record)
            held.count(len(raw))
            self._deliver(raw, path, label, record, request, planner, held)

    def _try_streamed(
        self,
        stream: Any,
        path: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
    ) -> bool:
        """Load a plain tensor item from ``stream``; ``False`` after a transient error (the
        caller reads it again on a fresh stream)."""
        try:
            if self._load_known(stream, path, label, record, request, planner):
                return True
            if record.transforms:
                return False  # read whole and decoded by the caller
            with self._budget.admit(record.length) as held:
                tensor = self._load_streamed(stream, path, label, record, held=held)
                self._hand_over(tensor, path, label, request, planner)
            return True
        except CheckpointCorruptError:
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            return False

    def _raw_cost(self, record: ItemRecord, request: ReadItem) -> int:
        """The most transient bytes reading ``record`` whole and delivering it holds: its
        stored bytes, what they decompress to and, for an object, its re-serialized copy."""
        if request.type == LoadItemType.BYTE_IO:
            bound = self._object_bound(record)
            decoded = record.length if not record.transforms else bound
            return _UNBOUNDED_BYTES if decoded is None else record.length + 2 * decoded
        stored = self._stored.get(record.key)
        if not record.transforms or stored is None:
            return record.length
        return record.length + tensor_item_bound(*stored)

    def _object_bound(self, record: ItemRecord) -> int | None:
        """The most bytes an object item may decode to (``None``: as many as it holds, for a
        root trusted with pickles)."""
        return None if self.allow_pickle else max(OBJECT_MAX_DECODED_BYTES, record.length)

    def _load_known(
        self,
        stream: Any,
        path: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
        *,
        verify: bool | None = None,
    ) -> bool:
        """Read a plain-tensor item (zstd too) without ``torch.load``: only the blocks the
        request needs where the item has block digests (:mod:`dcp_safe.dcp.range_reads`), else
        straight into the destination when it is the whole stored tensor, contiguous and on
        CPU, else via a fresh tensor. ``False``: not such an item."""
        stored = self._stored.get(item_key(request.storage_index.fqn, request.storage_index.offset))
        if stored is None:
            return False
        require_stored(stream, path, label, record)
        verify = self.verify if verify is None else verify
        got = self._ranges.load(stream, path, label, record, stored, request, planner, verify)
        if got is not None:
            with self._lock:  # counted whole by read_data
                self.bytes_read -= record.length - got
            return True
        dtype, shape = stored
        layout = known_layout(dtype, shape, record)
        if layout is None:
            return False
        with self._lock:
            target = planner.resolve_tensor(request).detach()
        direct = (
            target.device.type == "cpu"
            and target.dtype == dtype
            and tuple(target.shape) == shape
            and target.is_contiguous()
            and not any(request.storage_offsets)
            and tuple(request.lengths) == shape
        )
        # What is allocated below is known exactly: the read's own buffers and, unless the
        # target takes the bytes directly, a tensor of the stored shape.
        cost = transient_bytes(layout, record) + (0 if direct else layout.payload)
        with self._budget.admit(cost) as held:
            held.count(cost)
            dest = target if direct else transient_tensor(shape, dtype)
            if not read_tensor_item(
                stream,
                path=path,
                item=label,
                record=record,
                layout=layout,
                checksum=record.checksum if verify else None,
                dest=dest,
                hash_pool=self._hash_pool,
            ):
                return False
            if direct:
                with self._lock:
                    planner.commit_tensor(request, target)
            else:
                self._hand_over(dest, path, label, request, planner)
        return True

    def _load_streamed(
        self,
        stream: Any,
        path: str,
        label: str,
        record: ItemRecord,
        *,
        held: Admission,
        verify: bool | None = None,
    ) -> torch.Tensor:
        """Any other uncompressed tensor item: read whole, verified (``verify``: as for
        :meth:`_read_raw`), then decoded over that memory by :mod:`dcp_safe.checkpoints.items`
        (its bytes counted in ``held``, admitted at ``record.length``)."""
        verify = self.verify if verify is None else verify
        require_stored(stream, path, label, record)
        held.count(record.length)
        raw = read_item(
            stream,
            path=path,
            item=label,
            start=record.start,
            length=record.length,
            checksum=record.checksum if verify else None,
        )
        return self._decode_tensor(raw, path, label, record, held)

    def _decode_tensor(
        self, raw: bytes | bytearray, path: str, label: str, record: ItemRecord, held: Admission
    ) -> torch.Tensor:
        stored = self._stored.get(record.key)
        if stored is None:
            raise CheckpointCorruptError(path, "no tensor of the metadata lies here", item=label)
        dtype, shape = stored
        data = decode_transforms(
            raw,
            record.transforms,
            max_bytes=tensor_item_bound(dtype, shape),
            path=path,
            item=label,
        )
        if data is not raw:
            held.count(len(data))  # decompressed; the tensor is decoded over it
        return decode_tensor_item(data, dtype=dtype, shape=shape, path=path, item=label)

    def _read_raw_retrying(self, rel: str, stream: Any, label: str, record: ItemRecord) -> bytes:
        """Read an item; after a transient error, retry it on a fresh stream within the policy."""
        backend = self._source
        path = backend.full_path(rel)
        try:
            return self._read_raw(stream, path, label, record)
        except Exception as exc:
            if not is_transient(exc):
                raise

        def again() -> bytes:
            with backend.open_read(rel) as fresh:
                return self._read_raw(fresh, path, label, record)

        return call_with_retries("read", path, again, self.retry)

    def _spare_tier(self) -> Backend | None:
        """The other tier, if it holds this very checkpoint (the same manifest)."""
        with self._lock:
            if not self._spare_checked:
                self._spare_checked = True
                other = self.fallback if self._source is self.backend else self.backend
                if other is not None and self._name is not None:
                    with contextlib.suppress(CheckpointNotFoundError, CheckpointCorruptError):
                        if open_committed(other, self._name).manifest == self._manifest:
                            self._spare = other
            return self._spare

    def _load_from_spare(
        self,
        rel: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
        cause: BaseException | None,
    ) -> None:
        with self._budget.admit(self._raw_cost(record, request)) as held:
            raw = self._read_from_spare(rel, label, record, cause=cause)
            held.count(len(raw))
            path = self._source.full_path(rel)
            self._deliver(raw, path, label, record, request, planner, held)

    def _read_from_spare(
        self, rel: str, label: str, record: ItemRecord, cause: BaseException | None
    ) -> bytes:
        spare = self._spare_tier()
        if spare is None:
            if cause is not None:
                raise cause
            raise CheckpointCorruptError(self._source.full_path(rel), "file is missing")
        with spare.open_read(rel) as stream:
            raw = self._read_raw(stream, spare.full_path(rel), label, record)
        with self._lock:
            self.items_from_fallback += 1
        return raw

    def _deliver(
        self,
        raw: bytes,
        path: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
        held: Admission,
    ) -> None:
        """Decode ``raw`` (counted in ``held`` already) and hand it to the planner."""
        if request.type == LoadItemType.BYTE_IO:
            # Bounded unless the caller trusts the root (then as large as it decompresses).
            bound = self._object_bound(record)
            payload = decode_transforms(
                raw, record.transforms, max_bytes=bound, path=path, item=label
            )
            if payload is not raw:
                held.count(len(payload))
            safe = sanitized_object_stream(payload, path, label, allow_pickle=self.allow_pickle)
            with safe.getbuffer() as copy:
                held.count(copy.nbytes)
            with self._lock:
                planner.load_bytes(request, safe)
            return
        tensor = self._decode_tensor(raw, path, label, record, held)
        self._hand_over(tensor, path, label, request, planner)

    def _hand_over(
        self, tensor: torch.Tensor, path: str, label: str, request: ReadItem, planner: LoadPlanner
    ) -> None:
        tensor = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
        with self._lock:
            target = planner.resolve_tensor(request).detach()
        commit_into(target, tensor, path, label, request, planner, self._lock)
