"""``PeerCacheReader``: restore each file from the best verified source: this node's cache, a
peer copy (held on any node, fetched over the network), then the remote.

``read_data`` runs on every rank at the same point, so it begins with one exchange on a
dcp_safe-owned gloo group, before any item is read::

    every rank   needs: the files its plan reads that its own node cache lacks (by size)
                 offers: the files its node's disk holds that match the remote's manifest
                 (its node cache, and the peer copies under .peers/<name>/)
    every rank   all_gather_object of (needs, offers, copies tried, its disk); the same
                 fetch_plan everywhere
    every rank   sends what it was asked for (a thread), receives what it asked for (this
                 thread) into .peers/.restore-<id>/, every byte checked against the
                 manifest as it lands; a file that fails is named in the stats and asked
                 for again, from another node's copy, in the next round; the rounds end when
                 no rank has an untried copy left, and what is still missing comes from the
                 remote
    every rank   reads each file as the base class does: its own cache, then a peer copy
                 (fetched, or on its own disk), then the remote, each item verified again

A peer copy counts only where its marker matches its manifest and that manifest is the
remote's, as a node cache does (:mod:`dcp_safe.checkpoints.peer_copies`). The scratch folder
is removed once the reads are done. What is trusted: docs/resume.md, "Restoring after a node
is lost".
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.peer_copies import list_peer_copies
from dcp_safe.coordination.group import DEFAULT_DEADLINE_S, checkpoint_group
from dcp_safe.dcp.node_cache_reader import (
    NodeCacheReader,
    ReadSource,
    RejectionReason,
)
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.schema import ItemRecord
from dcp_safe.manifest.verify import items_by_file
from dcp_safe.replication.peer_schedule import Fetch, fetch_plan
from dcp_safe.replication.peer_transport import (
    DEFAULT_PEER_CHUNK_BYTES,
    SenderFailedError,
    receive_file,
    send_file,
)

__all__ = ["PEER_RESTORE", "PeerCacheReader"]

#: The purpose of the gloo group a restore's peer fetches travel on.
PEER_RESTORE = "peer-restore"

_Source = tuple[Backend, str]  # a backend and a file's path relative to its root

# What this node's disk may raise where it is unusable: a link in the way (``.peers/`` planted
# as a symlink) is refused as CheckpointCorruptError, never followed; either way the peer tier
# is passed by and the files are read from the next source.
_UNUSABLE = (OSError, CheckpointCorruptError)


class PeerCacheReader(NodeCacheReader):
    """A :class:`NodeCacheReader` that also reads other nodes' files from peer copies.

    Call order: DCP's (every rank); ``read_data`` is a collective on ``process_group``.

    Args:
        process_group: the group peer fetches travel on (its timeout is their deadline);
            default: dcp_safe's own group for them (created at the first ``read_data`` on
            every rank; none in a single process, which reads peer copies on its disk only).
        chunk_bytes: bytes per message.
        **kwargs: as for :class:`NodeCacheReader`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        node_cache: str | os.PathLike[str],
        process_group: Any = None,
        chunk_bytes: int = DEFAULT_PEER_CHUNK_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(root, node_cache=node_cache, **kwargs)
        self._group = process_group
        self.chunk_bytes = chunk_bytes
        self._peer_sources: dict[str, tuple[_Source, str]] = {}  # file -> source, its holder

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch what this node lacks from peers (a collective), then read as the base does."""
        self._peer_sources = {}
        scratch = layout.peer_restore_dir(layout.new_save_id())
        try:
            self._fetch(self._needs(plan), self._offers(), scratch)
            return super().read_data(plan, planner)
        finally:
            self._peer_sources = {}
            try:
                self.node_cache.remove_tree(scratch)
            except _UNUSABLE as exc:  # logged and counted: the load itself did not need it
                self._reject(None, RejectionReason.UNREADABLE, str(exc), ReadSource.PEER)

    # ----------------------------------------------------------------- sources

    def _local_sources(self, file_name: str) -> list[tuple[Backend, str, ReadSource]]:
        sources = super()._local_sources(file_name)
        found = self._peer_sources.get(file_name)
        if found is not None:
            (backend, rel), _ = found
            sources.append((backend, rel, ReadSource.PEER))
        return sources

    def _needs(self, plan: LoadPlan) -> dict[str, int]:
        """The files ``plan`` reads that this node's cache lacks (or holds at another size)."""
        assert self._metadata is not None and self._manifest is not None
        storage = self._metadata.storage_data
        wanted = {storage[item.storage_index].relative_path for item in plan.items}
        needs: dict[str, int] = {}
        held = self._sizes(self._cache, self._require_name()) if self._cache is not None else {}
        for file_name in sorted(wanted):
            record = self._manifest.file(file_name)
            if record is not None and held.get(file_name) != record.size:
                needs[file_name] = record.size
        return needs

    def _offers(self) -> dict[str, _Source]:
        """The files this node's disk holds for this checkpoint at their recorded sizes: its
        node cache's, then those of the peer copies whose manifest is the remote's."""
        assert self._manifest is not None
        name = self._require_name()
        found: list[tuple[str, _Source]] = []
        if self._cache is not None:
            found += [(f, (self._cache, f"{name}/{f}")) for f in self._sizes(self._cache, name)]
        try:
            copies = list_peer_copies(self.node_cache, name)
        except _UNUSABLE as exc:  # an unreadable .peers/ offers nothing; the exchange goes on
            self._reject(None, RejectionReason.UNREADABLE, str(exc), ReadSource.PEER)
            copies = []
        for copy in copies:
            if copy.manifest != self._manifest:
                self._reject(None, RejectionReason.STALE, f"peer copy {copy.path}", ReadSource.PEER)
                continue
            sizes = self._sizes(self.node_cache, copy.rel)
            found += [(f, (self.node_cache, f"{copy.rel}/{f}")) for f in sizes]
        offers: dict[str, _Source] = {}
        for file_name, source in found:
            offers.setdefault(file_name, source)
        return offers

    def _sizes(self, backend: Backend, folder: str) -> dict[str, int]:
        """The shard files directly in ``folder`` that have their recorded size."""
        assert self._manifest is not None
        try:
            sizes = backend.sizes(folder)
        except _UNUSABLE:
            return {}
        return {
            f: size
            for f, size in sizes.items()
            if (record := self._manifest.file(f)) is not None and record.size == size
        }

    # ----------------------------------------------------------------- the exchange

    def _fetch(self, needs: dict[str, int], offers: dict[str, _Source], scratch: str) -> None:
        """Fill ``_peer_sources``: peer copies on this node's disk, and files fetched from the
        ranks that hold them (a collective when the job has several ranks)."""
        for file_name in needs:
            if file_name in offers:  # a peer copy on this node's own disk
                self._peer_sources[file_name] = (offers[file_name], "this node")
        group = self._peer_group()
        if group is None:
            return
        rank = dist.get_rank(group)
        pending = {f: size for f, size in needs.items() if f not in self._peer_sources}
        tried: dict[str, list[str]] = {}
        disk = f"{socket.gethostname()}:{self.node_cache.full_path('')}"
        made = False
        while True:  # rounds: a rejected copy is fetched from another disk in the next one
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (pending, sorted(offers), tried, disk), group=group)
            fetches = fetch_plan(
                [g[0] for g in gathered],
                [set(g[1]) for g in gathered],
                [g[2] for g in gathered],
                [g[3] for g in gathered],
            )
            if not fetches:  # the same on every rank: every rank leaves the loop here
                return
            receives = [f for f in fetches if f.requester == rank]
            if receives and not made:  # where it fails, each landing fails and is named
                with contextlib.suppress(*_UNUSABLE):
                    self.node_cache.makedirs(scratch)
                made = True
            sends = [f for f in fetches if f.holder == rank]
            self._transfer(group, sends, receives, offers, scratch)
            disks = [g[3] for g in gathered]
            for fetch in receives:
                tried.setdefault(fetch.file, []).append(disks[fetch.holder])
                if fetch.file in self._peer_sources:
                    pending.pop(fetch.file, None)

    def _peer_group(self) -> Any:
        if self._group is not None:
            return self._group
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        self._group = checkpoint_group(DEFAULT_DEADLINE_S, purpose=PEER_RESTORE)
        return self._group

    def _transfer(
        self,
        group: Any,
        sends: list[Fetch],
        receives: list[Fetch],
        offers: dict[str, _Source],
        scratch: str,
    ) -> None:
        crashed: list[BaseException] = []

        def send_all() -> None:
            try:
                for fetch in sends:
                    backend, rel = offers[fetch.file]
                    send_file(
                        group,
                        fetch.requester,
                        backend,
                        rel,
                        fetch.size,
                        tag=fetch.tag,
                        chunk_bytes=self.chunk_bytes,
                    )
            except BaseException as exc:  # the transport's error: raised on this thread
                crashed.append(exc)

        sender = threading.Thread(target=send_all, name="dcp_safe-peer-restore", daemon=True)
        sender.start()
        try:
            if receives:
                assert self._manifest is not None
                by_file = items_by_file(self._require_name(), self._manifest)
            for fetch in receives:
                self._receive(group, fetch, scratch, by_file.get(fetch.file, []))
        finally:
            sender.join()
        if crashed:
            raise crashed[0]

    def _receive(self, group: Any, fetch: Fetch, scratch: str, items: list[ItemRecord]) -> None:
        assert self._manifest is not None
        record = self._manifest.file(fetch.file)
        assert record is not None  # needs come from the manifest
        rel = f"{scratch}/{fetch.file}"
        holder = f"rank {fetch.holder}"
        try:
            receive_file(
                group,
                fetch.holder,
                self.node_cache,
                rel,
                record,
                items,
                tag=fetch.tag,
                chunk_bytes=self.chunk_bytes,
            )
        except CheckpointCorruptError as exc:
            self._reject(fetch.file, RejectionReason.CHECKSUM, f"{holder}: {exc}", ReadSource.PEER)
        except SenderFailedError as exc:
            reason = RejectionReason.UNREADABLE
            self._reject(fetch.file, reason, f"{holder}: {exc}", ReadSource.PEER)
        except OSError as exc:
            detail = f"{holder}: landing here failed: {type(exc).__name__}: {exc}"
            self._reject(fetch.file, RejectionReason.UNREADABLE, detail, ReadSource.PEER)
        else:
            self._peer_sources[fetch.file] = ((self.node_cache, rel), holder)
