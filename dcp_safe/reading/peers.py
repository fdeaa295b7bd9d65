"""``PeerSource``: other nodes' files, from peer copies (held on any node, fetched over the
network), read after this node's cache and before the remote.

The reader's ``read_data`` runs on every rank at the same point, so the source's ``prepare``
is one exchange on a dcp_safe-owned gloo group, before any item is read::

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
    every rank   reads each file from its sources in order: its own cache, then a peer copy
                 (fetched, or on its own disk), then the remote, each item verified again

A peer copy counts only where its marker matches its manifest and that manifest is the
remote's, as a node cache does (:mod:`dcp_safe.checkpoints.node_cache`). The scratch folder
is removed once the reads are done (``finish``). What is trusted: docs/resume.md, "Restoring
after a node is lost".
"""

from __future__ import annotations

import contextlib
import functools
import socket
from typing import Any

import torch.distributed as dist

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.node_cache import held_files, list_peer_copies
from dcp_safe.coordination.group import DEFAULT_DEADLINE_S, checkpoint_group, gather_objects
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.manifest.verify import items_by_file
from dcp_safe.reading.sources import NodeCacheSource, ReadSource, RejectionReason, Source, SourceLog
from dcp_safe.replication.peer_schedule import Fetch, fetch_plan
from dcp_safe.replication.peer_transport import (
    PEER_RESTORE,
    SenderFailedError,
    exchange,
    receive_file,
    send_file,
)
from dcp_safe.torch_compat import rank_world

# What this node's disk may raise where it is unusable: a link in the way (``.peers/`` planted
# as a symlink) is refused as CheckpointCorruptError, never followed; either way the peer tier
# is passed by and the files are read from the next source.
_UNUSABLE = (OSError, CheckpointCorruptError)


class PeerSource(Source):
    """Peer copies of other nodes' files, on this node's disk (that of ``cache``, which also
    holds the fetched files) or fetched from the ranks holding them, on ``process_group`` (its
    timeout is their deadline; ``None``: dcp_safe's own, made at the first ``prepare`` on every
    rank; none in a single process, which reads peer copies on its disk only), ``chunk_bytes``
    a message."""

    kind = ReadSource.PEER
    _checkpoint: str  # the checkpoint and its remote manifest, set by ``open``
    _manifest: Manifest

    def __init__(self, cache: NodeCacheSource, process_group: Any, chunk_bytes: int) -> None:
        self.cache = cache
        self.disk = cache.backend
        self._group = process_group
        self.chunk_bytes = chunk_bytes
        self._log = SourceLog()
        self._scratch: str | None = None
        self._peer_sources: dict[str, str] = {}  # file -> where on this node's disk it is read

    def open(self, name: str, manifest: Manifest, log: SourceLog) -> None:
        self._checkpoint = name
        self._manifest = manifest

    def prepare(self, files: set[str], log: SourceLog) -> None:
        """Fetch what this node lacks from peers: a collective on every rank."""
        self._log = log
        self._scratch = layout.peer_restore_dir(layout.new_save_id())
        # The files this node's own cache holds.
        held = self._held(self._checkpoint) if self.cache.name is not None else {}
        # Sized as the receiver's check will be: by the manifest's record of each path.
        records = [self._manifest.file(f) for f in sorted(files - held.keys())]
        needs = {r.path: r.size for r in records if r is not None}
        self._fetch(needs, self._offers(held), self._scratch)

    def where(self, file_name: str) -> tuple[Backend, str] | None:
        rel = self._peer_sources.get(file_name)
        return None if rel is None else (self.disk, rel)

    def finish(self, log: SourceLog) -> None:
        scratch = self._scratch
        self._scratch = None
        self._peer_sources = {}
        if scratch is None:
            return
        try:
            self.disk.remove_tree(scratch)
        except _UNUSABLE as exc:  # logged and counted: the load itself did not need it
            log.reject(None, RejectionReason.UNREADABLE, str(exc), self.kind)

    def _offers(self, held: dict[str, int]) -> dict[str, str]:
        """Where on this node's disk each file of this checkpoint is at its recorded size: its
        node cache's (``held``), then those of the peer copies whose manifest is the remote's."""
        found = [(f, f"{self._checkpoint}/{f}") for f in held]
        try:
            copies = list_peer_copies(self.disk, self._checkpoint)
        except _UNUSABLE as exc:  # an unreadable .peers/ offers nothing; the exchange goes on
            self._log.reject(None, RejectionReason.UNREADABLE, str(exc), self.kind)
            copies = []
        for copy in copies:
            if copy.manifest != self._manifest:
                self._log.reject(None, RejectionReason.STALE, f"peer copy {copy.path}", self.kind)
                continue
            found += [(f, f"{copy.rel}/{f}") for f in self._held(copy.rel)]
        return dict(reversed(found))  # the first found of each file

    def _held(self, folder: str) -> dict[str, int]:
        """The files of ``folder`` on this node's disk at their recorded size (none where it is
        unusable)."""
        try:
            return held_files(self.disk, folder, self._manifest)
        except _UNUSABLE:
            return {}

    def _fetch(self, needs: dict[str, int], offers: dict[str, str], scratch: str) -> None:
        """Fill ``_peer_sources``: peer copies on this node's disk, and files fetched from the
        ranks that hold them (a collective when the job has several ranks)."""
        # Peer copies on this node's own disk first.
        self._peer_sources = {f: offers[f] for f in needs if f in offers}
        if self._group is None and rank_world()[1] > 1:
            self._group = checkpoint_group(DEFAULT_DEADLINE_S, purpose=PEER_RESTORE)
        if self._group is None:
            return
        rank = dist.get_rank(self._group)
        pending = {f: size for f, size in needs.items() if f not in self._peer_sources}
        tried: dict[str, list[str]] = {}
        disk = f"{socket.gethostname()}:{self.disk.full_path('')}"
        while True:  # rounds: a rejected copy is fetched from another disk in the next one
            gathered = gather_objects((pending, sorted(offers), tried, disk), self._group)
            wanted, offered, tries, disks = zip(*gathered, strict=True)
            fetches = fetch_plan(wanted, [set(names) for names in offered], tries, disks)
            if not fetches:  # the same on every rank: every rank leaves the loop here
                return
            receives = [f for f in fetches if f.requester == rank]
            if receives:  # where it fails, each landing fails and is named
                with contextlib.suppress(*_UNUSABLE):
                    self.disk.makedirs(scratch)
            sends = [f for f in fetches if f.holder == rank]
            self._transfer(self._group, sends, receives, offers)
            for fetch in receives:
                tried.setdefault(fetch.file, []).append(disks[fetch.holder])
                if fetch.file in self._peer_sources:
                    pending.pop(fetch.file, None)

    def _transfer(
        self, group: Any, sends: list[Fetch], receives: list[Fetch], offers: dict[str, str]
    ) -> None:
        """Send ``sends`` and receive ``receives`` into the scratch folder, at once."""
        send = functools.partial(send_file, group, chunk_bytes=self.chunk_bytes)
        receive = functools.partial(receive_file, group, chunk_bytes=self.chunk_bytes)

        def send_all() -> None:
            for fetch in sends:
                send(fetch.requester, self.disk, offers[fetch.file], fetch.size, tag=fetch.tag)

        def receive_all() -> None:
            by_file = items_by_file(self._checkpoint, self._manifest) if receives else {}
            for fetch in receives:
                record = self._manifest.file(fetch.file)
                assert record is not None  # needs come from the manifest
                rel = f"{self._scratch}/{fetch.file}"
                items = by_file.get(fetch.file, [])
                try:
                    receive(fetch.holder, self.disk, rel, record, items, tag=fetch.tag)
                except (CheckpointCorruptError, OSError) as exc:  # SenderFailedError: an OSError
                    corrupt = isinstance(exc, CheckpointCorruptError)
                    reason = RejectionReason.CHECKSUM if corrupt else RejectionReason.UNREADABLE
                    here = corrupt or isinstance(exc, SenderFailedError)
                    why = str(exc) if here else f"landing here failed: {type(exc).__name__}: {exc}"
                    self._log.reject(fetch.file, reason, f"rank {fetch.holder}: {why}", self.kind)
                else:
                    self._peer_sources[fetch.file] = rel

        exchange(send_all, receive_all, "dcp_safe-peer-restore")
