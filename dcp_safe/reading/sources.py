"""Where a restore reads each file from, best first: this node's cache, a peer copy, the remote.

A *source* is a partial copy read before the remote (the one complete copy, the authority on
"latest"): this node's cache (:class:`NodeCacheSource`, :mod:`dcp_safe.checkpoints.node_cache`)
and peer copies (:class:`~dcp_safe.reading.peers.PeerSource`). At ``reset`` each checks that it
holds the remote's very checkpoint; per file it names where it would read it, or nothing. The
reader (:class:`~dcp_safe.adapters.reader.SafeStorageReader`) tries them in order, every item
verified whatever ``verify`` says, and reads what none delivered from the remote: a bad copy
never fails a load the remote can serve. Each copy not used is logged with its reason
(:class:`SourceLog`). What is trusted and when: docs/fsdp.md, "Restoring from the node caches".

Sources, not reader subclasses: the fall-through is one loop in the reader, and a source is
only "where is this file, and is it this checkpoint". Not ``SafeStorageReader(fallback=)``
either: that picks the newest of two complete checkpoints; a partial copy is never chosen.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import Enum

from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.node_cache import open_node_cache
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.schema import Manifest

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
        files_from_peer: files finished from a peer copy (``peers=True``).
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
        return int(getattr(self, f"files_from_{_FIELD[source]}"))

    def bytes_from(self, source: ReadSource) -> int:
        """Stored bytes ``source`` delivered."""
        return int(getattr(self, f"bytes_from_{_FIELD[source]}"))


_FIELD = {ReadSource.NODE_CACHE: "cache", ReadSource.PEER: "peer", ReadSource.REMOTE: "remote"}


class Rejected(Exception):
    """A copy, or one file of it, is not used: ``reason`` and ``detail`` say why."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class SourceLog:
    """What the sources did since ``reset`` (files and bytes each delivered, every rejection),
    shared by the reader's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {f"{n}_from_{s}": 0 for n in ("files", "bytes") for s in _FIELD.values()}
        self._rejections: list[CacheRejection] = []

    def reject(
        self, file_name: str | None, reason: RejectionReason, detail: str, source: ReadSource
    ) -> None:
        with self._lock:
            self._rejections.append(CacheRejection(file_name, reason, detail, source))
        quiet = reason in (RejectionReason.NO_CACHE, RejectionReason.MISSING)
        where = f"the {source.value}" if file_name is None else f"{file_name} from {source.value}"
        message = "not reading %s (%s): %s; reading it from the next source instead"
        log.log(logging.DEBUG if quiet else logging.WARNING, message, where, reason.value, detail)

    def reject_file(self, file_name: str, path: str, exc: Exception, source: ReadSource) -> None:
        if isinstance(exc, Rejected):
            reason, detail = exc.reason, exc.detail
        elif isinstance(exc, FileNotFoundError):
            reason, detail = RejectionReason.MISSING, path
        elif isinstance(exc, CheckpointCorruptError):
            reason, detail = RejectionReason.CHECKSUM, str(exc)
        else:
            reason, detail = RejectionReason.UNREADABLE, f"{type(exc).__name__}: {exc}"
        self.reject(file_name, reason, detail, source)

    def count(self, source: ReadSource, stored_bytes: int, *, finished: bool) -> None:
        """``source`` delivered ``stored_bytes`` of a file (all that was left: ``finished``)."""
        with self._lock:
            self._counts[f"bytes_from_{_FIELD[source]}"] += stored_bytes
            self._counts[f"files_from_{_FIELD[source]}"] += finished

    def stats(self, cache_path: str | None) -> NodeCacheStats:
        with self._lock:
            rejections = tuple(self._rejections)
            return NodeCacheStats(cache_path=cache_path, rejections=rejections, **self._counts)


class Source:
    """A copy of the checkpoint's files, read in order (a partial copy before the remote).

    Call order (by the reader, every rank): ``open`` in ``reset``; ``prepare`` at the start of
    each ``read_data`` (a collective where the source says so), then ``where`` per file, on the
    reader's threads; ``finish`` once the reads are done. This base is a copy under the
    checkpoint's name on one backend: once ``open``, it names every file (read as is: the
    reader checks sizes and items).
    """

    kind: ReadSource

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name: str | None = None  # the checkpoint, once the copy is known to be its own

    def open(self, name: str, manifest: Manifest, log: SourceLog) -> None:
        self.name = name

    def prepare(self, files: set[str], log: SourceLog) -> None:
        """Get ready to serve ``files`` (those this rank's plan reads)."""

    def where(self, file_name: str) -> tuple[Backend, str] | None:
        """The backend and path (relative to it) to read ``file_name`` from, or ``None``."""
        return None if self.name is None else (self.backend, f"{self.name}/{file_name}")

    def finish(self, log: SourceLog) -> None:
        """The reads are done: drop anything held for them."""


class RemoteSource(Source):
    """The one complete copy, read last: the root (or fallback) ``reset`` chose and checked."""

    kind = ReadSource.REMOTE


class NodeCacheSource(Source):
    """This node's cache (``NodeLocalWriter``'s root), used where it holds the remote's save."""

    kind = ReadSource.NODE_CACHE

    @property
    def path(self) -> str | None:  # None: missing or ignored
        return None if self.name is None else self.backend.full_path(self.name)

    def open(self, name: str, manifest: Manifest, log: SourceLog) -> None:
        self.name = None
        try:
            cached = open_node_cache(self.backend, name)
        except CheckpointNotFoundError as exc:
            reason, detail = RejectionReason.NO_CACHE, str(exc)
        except CheckpointCorruptError as exc:
            reason, detail = RejectionReason.BAD_MARKER, str(exc)
        except OSError as exc:
            reason, detail = RejectionReason.UNREADABLE, f"{type(exc).__name__}: {exc}"
        else:
            if cached.manifest == manifest:
                self.name = name
                return
            reason = RejectionReason.STALE
            detail = (
                f"node cache {cached.path} is save {cached.manifest.save_id}, "
                f"the remote is save {manifest.save_id}"
            )
        log.reject(None, reason, detail, self.kind)
