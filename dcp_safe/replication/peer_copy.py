"""One committed checkpoint's node caches copied to other nodes: the peer tier's write side.

Runs on every rank, in the same order of checkpoints everywhere, after the remote commit and
each node's cache are published (docs/architecture.md, "The peer tier")::

    node leaders    offer the files their node cache holds with their recorded sizes
    every rank      all_gather_object of the offers; the same copy_plan everywhere
    node leaders    send their node's files to each buddy node's leader (a thread), receive
                    their buddies' files (this thread), each checked as it lands, into a
                    hidden partial folder; commit each complete copy (marker last, rename)
    every rank      all_gather_object of the outcomes: every rank raises the same
                    PeerCopyError when any copy failed

A failed copy leaves no peer copy (its partial folder is removed); a transport failure (a peer
died, the deadline passed) raises the transport's error, and the group cannot be used again.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import read_marked_manifest
from dcp_safe.checkpoints.node_cache import (
    commit_peer_copy,
    held_files,
    open_node_cache,
    prune_peer_copies,
)
from dcp_safe.coordination.group import gather_objects
from dcp_safe.errors import CheckpointCorruptError, DcpSafeError, PeerCopyError, describe
from dcp_safe.manifest.schema import FileRecord, Manifest
from dcp_safe.manifest.verify import items_by_file
from dcp_safe.replication.peer_schedule import CopyTransfer, copy_plan, node_leaders
from dcp_safe.replication.peer_transport import exchange, receive_file, send_file


@dataclass(frozen=True)
class PeerGroup:
    """The ranks of a job and their nodes, on one dcp_safe-owned gloo group."""

    group: Any  # the peer messages travel on it; its timeout is their deadline
    rank: int  # this rank in ``group``
    nodes: tuple[int, ...]  # the node of every rank, by rank

    @property
    def node(self) -> int:
        return self.nodes[self.rank]

    @property
    def node_count(self) -> int:
        return len(set(self.nodes))

    def leads_node(self) -> bool:
        return node_leaders(self.nodes)[self.node] == self.rank


def copy_to_peers(
    name: str,
    *,
    peers: PeerGroup,
    copies: int,
    local: Backend,
    remote: Backend,
    keep: int | None = None,
) -> list[str]:
    """Copy each node's cache of ``name`` into the node caches of ``copies - 1`` other nodes;
    the peer copies committed on this rank (folders relative to ``local``).

    Call on every rank with the same arguments but ``local`` (this node's root). ``keep``: peer
    copies of this many checkpoints are kept on this node afterwards (``None``: all).

    Raises:
        PeerCopyError: on every rank, when any copy failed (with each failing rank's reason).
        RuntimeError: the transport's error (a peer died or the deadline passed).
    """
    offer: list[tuple[str, int]] | None = None
    failed: str | None = None
    if peers.leads_node():
        try:
            manifest = open_node_cache(local, name).manifest
            offer = list(held_files(local, name, manifest).items())
        except (DcpSafeError, OSError) as exc:
            failed = f"node {peers.node} offered nothing: {describe(exc)}"
    offers = gather_objects((offer, failed), peers.group)
    transfers = copy_plan(peers.nodes, [o for o, _ in offers], copies)
    receives = [t for t in transfers if t.dst == peers.rank]
    send_errors: list[str] = []

    def send_all() -> None:
        for transfer in (t for t in transfers if t.src == peers.rank):
            for path, size in transfer.files:
                error = send_file(
                    peers.group, transfer.dst, local, f"{name}/{path}", size, tag=transfer.tag
                )
                if error is not None:
                    send_errors.append(f"sending {path} to rank {transfer.dst}: {error}")

    def receive_all() -> list[tuple[str, str | None]]:
        raw = _committed_manifest(local, remote, name) if receives else b""
        return [_receive_copy(name, t, peers.group, local, raw) for t in receives]

    received = exchange(send_all, receive_all, f"dcp_safe-peer-send-{name}")
    errors = [error for _, error in received if error is not None] + send_errors
    if peers.leads_node() and keep is not None:
        try:
            prune_peer_copies(local, keep)
        except OSError as exc:  # reported with the outcomes: every rank must reach the gather
            errors.append(f"pruning peer copies: {describe(exc)}")
    outcomes = gather_objects("; ".join(errors) or None, peers.group)
    failures = {rank: why for rank, (_, why) in enumerate(offers) if why}
    failures |= {rank: why for rank, why in enumerate(outcomes) if why}
    if failures:
        raise PeerCopyError(name, failures)
    return [folder for folder, error in received if error is None]


def _receive_copy(
    name: str, transfer: CopyTransfer, group: Any, local: Backend, raw: bytes | str
) -> tuple[str, str | None]:
    """Receive one node's files and commit them as its peer copy: the copy's folder, and why
    not. Every file is received, whatever fails (``raw``: why there is no manifest), so that
    both ends stay in step."""
    partial = layout.peer_partial_dir(name, transfer.node, layout.new_save_id())
    failure: str | None = raw if isinstance(raw, str) else None
    manifest, by_file = None, {}
    receive = functools.partial(receive_file, group, transfer.src, local, tag=transfer.tag)
    try:
        if isinstance(raw, bytes):
            manifest = Manifest.from_json(raw, local.full_path(name))
            by_file = items_by_file(local.full_path(name), manifest)
        local.makedirs(f"{partial}/{layout.RANKS_DIR}")
    except (CheckpointCorruptError, OSError) as exc:  # every file is still received, dropped
        failure = failure or describe(exc)
    for path, size in transfer.files:
        record = None if manifest is None else manifest.file(path)
        if record is None or record.size != size:  # another save's offer: land it nowhere
            record = FileRecord(path=path, size=size)
            failure = failure or f"{path} is not in the manifest"
        try:
            receive(f"{partial}/{path}", record, by_file.get(path, []))
        except (CheckpointCorruptError, OSError) as exc:
            failure = failure or f"{path} from rank {transfer.src}: {exc}"
    try:
        if failure is None and isinstance(raw, bytes):
            return commit_peer_copy(local, partial, name, transfer.node, raw), None
    except (DcpSafeError, OSError) as exc:
        failure = f"committing node {transfer.node}'s copy: {exc}"
    with contextlib.suppress(OSError):
        local.remove_tree(partial)
    return partial, f"node {transfer.node}'s copy of {name}: {failure}"


def _committed_manifest(local: Backend, remote: Backend, name: str) -> bytes | str:
    """The committed manifest's bytes: from this node's cache of ``name`` (published from the
    remote's), else from the remote; or why neither could be read."""
    tiers = (
        (local, layout.NODE_COMMITTED_MARKER, "node cache"),
        (remote, layout.COMMITTED_MARKER, "checkpoint"),
    )
    for backend, marker, kind in tiers:
        try:
            return read_marked_manifest(backend, name, marker, kind, backend.full_path(name))[0]
        except (OSError, CheckpointCorruptError) as exc:
            why = f"no committed manifest of {name}: {describe(exc)}"
    return why
