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
import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dcp_safe import layout
from dcp_safe.adapters.options import READER_MOVED
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.retry import RetryPolicy, call_with_retries
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import check_signed, open_committed, resolve_name
from dcp_safe.checkpoints.items import stored_tensors
from dcp_safe.checkpoints.metadata import read_dcp_metadata
from dcp_safe.choices import refuse_moved, require_int
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DcpSafeError,
)
from dcp_safe.manifest.schema import ItemRecord, Manifest, item_key
from dcp_safe.manifest.signing import resolve_key
from dcp_safe.reading.budget import LoadBudget, LoadMemoryStats
from dcp_safe.reading.items import CopyFailed, ItemReader
from dcp_safe.reading.peers import PeerSource
from dcp_safe.reading.plain import PlainReader, done
from dcp_safe.reading.sources import (
    NodeCacheSource,
    NodeCacheStats,
    ReadSource,
    Rejected,
    RejectionReason,
    RemoteSource,
    Source,
    SourceLog,
)
from dcp_safe.replication.peer_transport import DEFAULT_PEER_CHUNK_BYTES
from dcp_safe.topology import Root, RootLike, as_root


class SafeStorageReader(PlainReader):
    """Load committed checkpoints from ``root``, verifying every byte it uses.

    Args:
        root: a directory, an fsspec URL, or a :class:`~dcp_safe.topology.Root` with its fsspec
            options (as are ``fallback`` and ``node_cache``; ``storage_options`` is the
            shorthand, which a ``fallback`` given as a path or URL gets too).
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
            target state (:class:`~dcp_safe.reading.budget.LoadBudget`); ``None``: no bound.
            What was held: :meth:`memory_stats`.
        node_cache: this node's local root (``NodeLocalWriter``'s ``root``): each file is read
            from this node's cache where it holds the remote's very save, every item verified,
            and from the remote otherwise (a bad cache never fails a load the remote can serve).
            Where each file came from, and why a copy was passed by: :meth:`stats`.
        peers: also read other nodes' files from peer copies (after this node's cache, before
            the remote); ``read_data`` is then a collective on ``process_group`` (default:
            dcp_safe's own group; its timeout is the deadline). Needs ``node_cache``.

    Raises:
        ConfigError: ``verify=False`` with a signing key (unverified bytes prove nothing), an
            argument out of its range, or a keyword that moved into a root
            (:data:`~dcp_safe.adapters.options.READER_MOVED`).
    """

    def __init__(
        self,
        root: RootLike,
        *,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        checkpoint_id: str = layout.LATEST,
        fallback: RootLike | None = None,
        retry: RetryPolicy | None = None,
        allow_pickle: bool = False,
        signing_key: bytes | str | None = None,
        thread_count: int | None = None,
        load_budget_bytes: int | None = None,
        node_cache: RootLike | None = None,
        peers: bool = False,
        process_group: Any = None,
        peer_chunk_bytes: int = DEFAULT_PEER_CHUNK_BYTES,
        **moved: Any,
    ) -> None:
        super().__init__()
        refuse_moved(type(self).__name__, moved, READER_MOVED)
        budget = LoadBudget(load_budget_bytes)
        self.load_budget_bytes = budget.budget_bytes
        if thread_count is not None:
            require_int("thread_count", thread_count, 1)
        self.thread_count = thread_count or max(1, min(4, os.cpu_count() or 1))
        self.allow_pickle = allow_pickle
        self._signing_key = resolve_key(signing_key)
        if self._signing_key is not None and not verify:
            raise ConfigError(
                "verify=False with a signing key: the signature vouches for the item checksums,"
                " so unverified items would load unauthenticated; drop one of the two"
            )
        main = as_root(root, storage_options)
        self.root = main.url
        self.verify = verify
        self.retry = retry or RetryPolicy()
        self.backend: Backend = open_backend(main, retry=retry)
        if fallback is not None and not isinstance(fallback, Root):
            fallback = dataclasses.replace(main, url=os.fspath(fallback))  # the root's options
        self.fallback = None if fallback is None else open_backend(fallback, retry=retry)
        if peers and node_cache is None:
            raise ConfigError("peers=True reads peer copies on this node's disk: pass node_cache")
        #: This node's cache root (``None``: the reader has none).
        self.node_cache = None if node_cache is None else open_backend(node_cache, retry=retry)
        self._cache = None if self.node_cache is None else NodeCacheSource(self.node_cache)
        self._remote = RemoteSource(self.backend)
        #: Where each file is read from, best first; the remote, last, holds every file.
        self.sources: list[Source] = [] if self._cache is None else [self._cache]
        if peers and self._cache is not None:
            self.sources.append(PeerSource(self._cache, process_group, peer_chunk_bytes))
        self.sources.append(self._remote)
        self._requested = checkpoint_id
        #: The resolved name of the checkpoint being read (after ``reset``).
        self.checkpoint_id: str | None = None
        self._manifest: Manifest | None = None
        self._spare: Backend | None = None
        self._spare_checked = False
        self.items_from_fallback = 0
        # Files are read on several threads, sharing the planner, the spare tier and counters.
        self._lock = threading.RLock()
        self._items = ItemReader(self._lock, budget, verify=verify, allow_pickle=allow_pickle)
        self._log = SourceLog()

    @property
    def bytes_read(self) -> int:
        """Stored bytes this reader was asked to read since ``reset``: each item's stored length
        (or its blocks a partial read used) once, whatever source served it, retries or not."""
        return self._items.bytes_read

    @property
    def items_read(self) -> int:
        """Items this reader was asked to read since ``reset``."""
        return self._items.items_read

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Resolve and open the checkpoint, then check each partial source's copy of it (one
        that does not match is passed by, never an error).

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
        for order, backend in enumerate(tiers):
            try:
                name = resolve_name(backend, self._requested, signing_key=self._signing_key)
                committed = open_committed(backend, name)
                manifest = committed.manifest
                if self._signing_key is not None:
                    check_signed(backend, committed, self._signing_key)
                metadata = read_dcp_metadata(
                    backend, name, manifest, allow_pickle=self.allow_pickle
                )
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
        # The keys differ (by order), so nothing past them is ever compared.
        _, self._remote.backend, self.checkpoint_id, self._manifest, self._metadata = max(opened)
        self._spare, self._spare_checked = None, False
        self.items_from_fallback = 0
        self._items.reset(stored_tensors(self._metadata))
        self._log = SourceLog()
        for source in self.sources:
            source.open(self.checkpoint_id, self._manifest, self._log)

    def memory_stats(self) -> LoadMemoryStats:
        """Transient host memory the reads held since the last ``reset`` (this rank)."""
        return self._items.budget.stats()

    def stats(self) -> NodeCacheStats:
        """Where the files read since the last ``reset`` came from, and why a copy was not used."""
        return self._log.stats(None if self._cache is None else self._cache.path)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None:
            raise ConfigError("SafeStorageReader used before reset()")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and hand over every item of ``plan``, one file at a time in file order,
        each file from the first source that delivers it (a collective with ``peers``).

        Raises:
            CheckpointCorruptError: a file is missing or short on the remote, or an item's
                checksum differs there.
        """
        assert self.checkpoint_id is not None and self._metadata is not None
        storage = self._metadata.storage_data
        by_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            by_file.setdefault(storage[request.storage_index].relative_path, []).append(request)
        with self._lock:
            self._items.items_read += len(plan.items)
            self._items.bytes_read += self._stored_bytes(plan.items)
        for requests in by_file.values():
            requests.sort(key=lambda r: storage[r.storage_index].offset)
        workers = max(1, min(self.thread_count, len(by_file)))
        try:
            for source in self.sources:
                source.prepare(set(by_file), self._log)
            # One helper thread per reader thread hashes a large item's chunk while the next is
            # read; the first failure, in file order, is raised once every read has ended.
            with (
                ThreadPoolExecutor(workers, thread_name_prefix="dcp_safe-hash") as hashing,
                ThreadPoolExecutor(workers, thread_name_prefix="dcp_safe-read") as pool,
            ):
                self._items.hash_pool = hashing if self.verify else None
                list(pool.map(self._read_file, by_file, by_file.values(), repeat(planner)))
        finally:
            self._items.hash_pool = None
            for source in self.sources:
                source.finish(self._log)
        return done()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        checkpoint_id = os.fspath(checkpoint_id)
        return checkpoint_id == layout.LATEST or layout.is_valid_name(checkpoint_id)

    def _stored_bytes(self, requests: list[ReadItem]) -> int:
        assert self._metadata is not None
        return sum(self._metadata.storage_data[r.storage_index].length for r in requests)

    def _read_file(self, file_name: str, remaining: list[ReadItem], planner: LoadPlanner) -> None:
        """Read ``file_name`` from each source in turn, each taking what the one before left."""
        for source in self.sources:
            if remaining and (where := source.where(file_name)) is not None:
                left = self._read_from(source.kind, *where, file_name, remaining, planner)
                done = self._stored_bytes(remaining[: len(remaining) - len(left)])
                self._log.count(source.kind, done, finished=not left)
                remaining = left

    def _read_from(
        self,
        kind: ReadSource,
        backend: Backend,
        rel: str,
        file_name: str,
        requests: list[ReadItem],
        planner: LoadPlanner,
    ) -> list[ReadItem]:
        """Deliver ``requests`` from ``backend``'s ``rel``; return those left for the next source.

        A partial copy must have the manifest's size and every item is verified; whatever
        reading it does wrong is logged, and the rest of the file left over. The remote leaves
        nothing: an item it cannot serve verified comes from the spare tier, or raises. An
        error while handing a verified item over would be the remote's too, and is raised.
        """
        remote = kind is ReadSource.REMOTE
        path = backend.full_path(rel)
        with contextlib.ExitStack() as stack:
            try:
                if not remote:
                    self._check_size(backend, rel, file_name)
                stream = stack.enter_context(backend.open_read(rel))
            except Exception as exc:
                if not remote:
                    self._log.reject_file(file_name, path, exc, kind)
                    return requests
                if not isinstance(exc, FileNotFoundError):
                    raise
                missing = CheckpointCorruptError(path, "file is missing")
                for request in requests:  # the remote's file is missing: all from the spare
                    self._load_from_spare(rel, request, planner, cause=missing)
                return []
            for done, request in enumerate(requests):
                label, record = self._record_for(path, request)
                again = self._again(rel, label, record) if remote else None
                try:
                    self._items.load(stream, path, label, record, request, planner, again=again)
                except CopyFailed as failed:  # whatever the copy does wrong: the next decides
                    self._log.reject_file(file_name, path, failed.cause, kind)
                    return requests[done:]
                except CheckpointCorruptError as exc:
                    if not remote:
                        raise
                    self._load_from_spare(rel, request, planner, cause=exc)
        return []

    def _check_size(self, copy: Backend, rel: str, file_name: str) -> None:
        assert self._manifest is not None
        record = self._manifest.file(file_name)
        if record is None:  # the remote read reports it
            raise Rejected(RejectionReason.MISSING, f"{file_name} is not in the manifest")
        if (size := copy.size(rel)) != record.size:
            raise Rejected(
                RejectionReason.SIZE,
                f"{copy.full_path(rel)}: expected {record.size} bytes, found {size}",
            )

    def _again(self, rel: str, label: str, record: ItemRecord) -> Callable[[], bytearray]:
        """Read an item again on a fresh stream of the remote, within the retry policy."""
        remote = self._remote.backend
        fresh = functools.partial(self._raw, remote, rel, label, record)
        return lambda: call_with_retries("read", remote.full_path(rel), fresh, self.retry)

    def _raw(self, backend: Backend, rel: str, label: str, record: ItemRecord) -> bytearray:
        """One item's stored bytes from ``backend``, on a fresh stream."""
        with backend.open_read(rel) as stream:
            return self._items.read_raw(stream, backend.full_path(rel), label, record)

    def _record_for(self, path: str, request: ReadItem) -> tuple[str, ItemRecord]:
        assert self._manifest is not None and self._metadata is not None
        index = request.storage_index
        info = self._metadata.storage_data[index]
        record = self._manifest.item(item_key(index.fqn, index.offset))
        label = index.fqn if index.offset is None else f"{index.fqn}@{list(index.offset)}"
        if record is None or (record.start, record.length) != (info.offset, info.length):
            raise CheckpointCorruptError(path, "item is not in the manifest", item=label)
        return label, record

    def _spare_tier(self) -> Backend | None:
        """The other tier, if it holds this very checkpoint (the same manifest)."""
        with self._lock:
            if not self._spare_checked:
                self._spare_checked = True
                other = self.fallback if self._remote.backend is self.backend else self.backend
                if other is not None and self.checkpoint_id is not None:
                    with contextlib.suppress(CheckpointNotFoundError, CheckpointCorruptError):
                        if open_committed(other, self.checkpoint_id).manifest == self._manifest:
                            self._spare = other
            return self._spare

    def _load_from_spare(
        self, rel: str, request: ReadItem, planner: LoadPlanner, cause: Exception
    ) -> None:
        """One item from the spare tier, its read on the remote having failed with ``cause``."""
        spare = self._spare_tier()
        if spare is None:
            raise cause
        path = self._remote.backend.full_path(rel)
        label, record = self._record_for(path, request)

        read = functools.partial(self._raw, spare, rel, label, record)
        self._items.load_bytes(read, path, label, record, request, planner)
        with self._lock:
            self.items_from_fallback += 1
