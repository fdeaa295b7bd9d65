"""``NodeCacheReader``: restore from the remote checkpoint, reading what this node has locally.

The remote is resolved and checked as by the base reader (the one complete copy, the authority
on "latest"); this node's cache of that save (:mod:`dcp_safe.checkpoints.node_cache`) is
consulted per file, every item verified, and the remote read instead on any failure: a bad
cache never fails a load the remote can serve. What is trusted and when: docs/fsdp.md,
"Restoring from the node caches".

A subclass, not ``SafeStorageReader(fallback=)``: that picks the newest of two complete
checkpoints; a node cache is never complete and never chosen.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.retry import RetryPolicy
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.node_cache import open_node_cache
from dcp_safe.dcp.reader import SafeStorageReader
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.schema import ItemRecord

__all__ = ["CacheRejection", "NodeCacheReader", "NodeCacheStats", "ReadSource", "RejectionReason"]

log = logging.getLogger(__name__)


class RejectionReason(str, Enum):
    """Why the node cache, or one file of it, was not used."""

    NO_CACHE = "no node cache"  # no committed node cache of that name on this node
    BAD_MARKER = "marker does not match its manifest"
    STALE = "manifest differs from the remote"  # another save of that name
    MISSING = "missing"
    SIZE = "size mismatch"
    CHECKSUM = "checksum mismatch"
    UNREADABLE = "unreadable"


class ReadSource(str, Enum):
    """Where a file's bytes came from, best first."""

    NODE_CACHE = "node cache"  # this node's own cache
    PEER = "peer"  # a peer copy: another node's files, held on some node (the peer tier)
    REMOTE = "remote"  # the commit root


@dataclass(frozen=True)
class CacheRejection:
    """One reason a copy was not used: for ``file`` (``None``: the whole cache) from
    ``source`` (the node cache, or a peer copy: ``detail`` names the rank that held it)."""

    file: str | None
    reason: RejectionReason
    detail: str = ""
    source: ReadSource = ReadSource.NODE_CACHE


@dataclass(frozen=True, kw_only=True)
class NodeCacheStats:
    """Where the files of the last load came from (counted per rank, since ``reset``).

    Attributes:
        cache_path: the node cache used, or ``None`` when it was missing or ignored.
        files_from_cache: files read entirely from the node cache.
        files_from_remote: files read, wholly or partly, from the remote.
        rejections: why each of those files (or the whole cache) was not read from the cache
            (or from a peer copy: ``source``).
        files_from_peer: files finished from a peer copy (``PeerCacheReader``).
        bytes_from_cache, bytes_from_peer, bytes_from_remote: the stored bytes of the items
            each source delivered (the remote's manifest and ``.metadata``, read by ``reset``
            on every restore, are not counted).
    """

    cache_path: str | None
    files_from_cache: int
    files_from_remote: int
    rejections: tuple[CacheRejection, ...]
    files_from_peer: int = 0
    bytes_from_cache: int = 0
    bytes_from_peer: int = 0
    bytes_from_remote: int = 0

    def files_from(self, source: ReadSource) -> int:
        """Files finished from ``source``."""
        return {
            ReadSource.NODE_CACHE: self.files_from_cache,
            ReadSource.PEER: self.files_from_peer,
            ReadSource.REMOTE: self.files_from_remote,
        }[source]

    def bytes_from(self, source: ReadSource) -> int:
        """Stored bytes ``source`` delivered."""
        return {
            ReadSource.NODE_CACHE: self.bytes_from_cache,
            ReadSource.PEER: self.bytes_from_peer,
            ReadSource.REMOTE: self.bytes_from_remote,
        }[source]


class _Rejected(Exception):
    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _CacheFailed(Exception):
    """Reading an item from the cache failed (not handing it over: that would fail from the
    remote too, and is raised as it is)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class NodeCacheReader(SafeStorageReader):
    """A ``SafeStorageReader`` of the remote ``root`` that reads files from this node's cache.

    Call order and checks are the base class's (every rank). Give every rank its own node's
    local root.

    Args:
        root: the shared remote root the checkpoint was committed to.
        node_cache: this node's local root (``NodeLocalWriter``'s ``root``).
        node_cache_storage_options: fsspec options for ``node_cache``, if it is a URL.
        verify, storage_options, checkpoint_id, retry, allow_pickle, signing_key,
            load_budget_bytes: as for :class:`SafeStorageReader`; ``verify`` applies to the
            remote only (the cache is used only where it matches the remote's manifest, which
            the key authenticates); the budget bounds the reads of both.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        node_cache: str | os.PathLike[str],
        node_cache_storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        checkpoint_id: str = layout.LATEST,
        retry: RetryPolicy | None = None,
        allow_pickle: bool = False,
        signing_key: bytes | str | None = None,
        load_budget_bytes: int | None = None,
    ) -> None:
        super().__init__(
            root,
            verify=verify,
            storage_options=storage_options,
            checkpoint_id=checkpoint_id,
            retry=retry,
            allow_pickle=allow_pickle,
            signing_key=signing_key,
            load_budget_bytes=load_budget_bytes,
        )
        self.node_cache: Backend = open_backend(
            os.fspath(node_cache), node_cache_storage_options, retry=retry
        )
        self._cache: Backend | None = None
        self._cache_path: str | None = None
        self._files = dict.fromkeys(ReadSource, 0)
        self._bytes = dict.fromkeys(ReadSource, 0)
        self._rejections: list[CacheRejection] = []

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Open the checkpoint on the remote (base class), then check this node's cache of it.

        Raises:
            The base class's errors, from the remote; never one from the cache.
        """
        super().reset(checkpoint_id)
        self._cache, self._cache_path = None, None
        self._files = dict.fromkeys(ReadSource, 0)
        self._bytes = dict.fromkeys(ReadSource, 0)
        self._rejections = []
        try:
            self._check_cache()
        except _Rejected as rejected:
            self._reject(None, rejected.reason, rejected.detail)
        else:
            self._cache = self.node_cache
            self._cache_path = self.node_cache.full_path(self._require_name())

    def stats(self) -> NodeCacheStats:
        """Where the files read since the last ``reset`` came from."""
        with self._lock:
            files, read = dict(self._files), dict(self._bytes)
            rejections = tuple(self._rejections)
        return NodeCacheStats(
            cache_path=self._cache_path,
            files_from_cache=files[ReadSource.NODE_CACHE],
            files_from_remote=files[ReadSource.REMOTE],
            rejections=rejections,
            files_from_peer=files[ReadSource.PEER],
            bytes_from_cache=read[ReadSource.NODE_CACHE],
            bytes_from_peer=read[ReadSource.PEER],
            bytes_from_remote=read[ReadSource.REMOTE],
        )

    # ----------------------------------------------------------------- helpers

    def _require_name(self) -> str:
        assert self._name is not None
        return self._name

    def _check_cache(self) -> None:
        """Raise ``_Rejected`` unless this node's cache holds the remote's very checkpoint."""
        name = self._require_name()
        try:
            cached = open_node_cache(self.node_cache, name)
        except CheckpointNotFoundError as exc:
            raise _Rejected(RejectionReason.NO_CACHE, str(exc)) from None
        except CheckpointCorruptError as exc:
            raise _Rejected(RejectionReason.BAD_MARKER, str(exc)) from None
        except OSError as exc:
            raise _Rejected(RejectionReason.UNREADABLE, f"{type(exc).__name__}: {exc}") from None
        if cached.manifest != self._manifest:
            assert self._manifest is not None
            raise _Rejected(
                RejectionReason.STALE,
                f"node cache {cached.path} is save {cached.manifest.save_id}, "
                f"the remote is save {self._manifest.save_id}",
            )

    def _reject(
        self,
        file_name: str | None,
        reason: RejectionReason,
        detail: str,
        source: ReadSource = ReadSource.NODE_CACHE,
    ) -> None:
        with self._lock:
            self._rejections.append(CacheRejection(file_name, reason, detail, source))
        quiet = reason in (RejectionReason.NO_CACHE, RejectionReason.MISSING)
        where = f"the {source.value}" if file_name is None else f"{file_name} from {source.value}"
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "not reading %s (%s): %s; reading it from the next source instead",
            where,
            reason.value,
            detail,
        )

    def _local_sources(self, file_name: str) -> list[tuple[Backend, str, ReadSource]]:
        """Where ``file_name`` may be read before the remote, best first: (backend, path
        relative to it, source)."""
        if self._cache is None:
            return []
        return [(self._cache, f"{self._require_name()}/{file_name}", ReadSource.NODE_CACHE)]

    def _read_file(self, file_name: str, requests: list[ReadItem], planner: LoadPlanner) -> None:
        """Read ``file_name`` from each local source in turn; what none could deliver, from the
        remote."""
        remaining = requests
        for backend, rel, source in self._local_sources(file_name):
            left = self._read_cached(backend, rel, file_name, remaining, planner, source)
            self._count(source, remaining[: len(remaining) - len(left)], finished=not left)
            remaining = left
            if not remaining:
                return
        self._count(ReadSource.REMOTE, remaining, finished=True)
        super()._read_file(file_name, remaining, planner)

    def _count(self, source: ReadSource, delivered: list[ReadItem], *, finished: bool) -> None:
        assert self._metadata is not None
        storage = self._metadata.storage_data
        with self._lock:  # files are read on several threads
            self._bytes[source] += sum(storage[r.storage_index].length for r in delivered)
            self._files[source] += finished

    def _read_cached(
        self,
        cache: Backend,
        rel: str,
        file_name: str,
        requests: list[ReadItem],
        planner: LoadPlanner,
        source: ReadSource = ReadSource.NODE_CACHE,
    ) -> list[ReadItem]:
        """Deliver ``requests`` from ``cache``'s ``rel``, verified; return those left over.

        Only reading the copy can reject it; an error while handing a verified item over
        (a shape mismatch, an unsafe pickle) would be the remote's too, and is raised.
        """
        path = cache.full_path(rel)
        with contextlib.ExitStack() as stack:
            try:
                self._check_size(cache, rel, file_name)
                stream = stack.enter_context(cache.open_read(rel))
            except Exception as exc:
                self._reject_file(file_name, path, exc, source)
                return requests
            for done, request in enumerate(requests):
                label, record = self._record_for(path, request)
                try:
                    self._load_cached(stream, path, label, record, request, planner)
                except _CacheFailed as failed:  # whatever the copy does wrong: the next decides
                    self._reject_file(file_name, path, failed.cause, source)
                    return requests[done:]
        return []

    def _load_cached(
        self,
        stream: Any,
        path: str,
        label: str,
        record: ItemRecord,
        request: ReadItem,
        planner: LoadPlanner,
    ) -> None:
        """One item from the cache, its checksum checked whatever ``verify`` says.

        Raises:
            _CacheFailed: reading it from the cache failed.
        """
        plain = request.type != LoadItemType.BYTE_IO and not record.transforms
        try:
            if request.type != LoadItemType.BYTE_IO and self._load_known(
                stream, path, label, record, request, planner, verify=True
            ):
                return
        except Exception as exc:
            raise _CacheFailed(exc) from exc
        with self._budget.admit(self._raw_cost(record, request)) as held:
            try:
                if plain:
                    tensor = self._load_streamed(
                        stream, path, label, record, held=held, verify=True
                    )
                else:
                    raw = self._read_raw(stream, path, label, record, verify=True)
                    held.count(len(raw))
            except Exception as exc:
                raise _CacheFailed(exc) from exc
            if plain:
                self._hand_over(tensor, path, label, request, planner)
            else:
                self._deliver(raw, path, label, record, request, planner, held)

    def _reject_file(
        self,
        file_name: str,
        path: str,
        exc: Exception,
        source: ReadSource = ReadSource.NODE_CACHE,
    ) -> None:
        if isinstance(exc, _Rejected):
            self._reject(file_name, exc.reason, exc.detail, source)
        elif isinstance(exc, FileNotFoundError):
            self._reject(file_name, RejectionReason.MISSING, path, source)
        elif isinstance(exc, CheckpointCorruptError):
            self._reject(file_name, RejectionReason.CHECKSUM, str(exc), source)
        else:
            reason = RejectionReason.UNREADABLE
            self._reject(file_name, reason, f"{type(exc).__name__}: {exc}", source)

    def _check_size(self, cache: Backend, rel: str, file_name: str) -> None:
        assert self._manifest is not None
        record = self._manifest.file(file_name)
        if record is None:  # the remote read reports it
            raise _Rejected(RejectionReason.MISSING, f"{file_name} is not in the manifest")
        size = cache.size(rel)
        if size != record.size:
            raise _Rejected(
                RejectionReason.SIZE,
                f"{cache.full_path(rel)}: expected {record.size} bytes, found {size}",
            )
