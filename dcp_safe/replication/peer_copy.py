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
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import read_marked_manifest
from dcp_safe.checkpoints.node_cache import (
    commit_peer_copy,
    held_files,
    open_node_cache,
    prune_peer_copies,
)
from dcp_safe.coordination.group import (
    checkpoint_group,
    discard_group,
    gather_objects,
    is_group_failure,
)
from dcp_safe.errors import (
    CheckpointCorruptError,
    ConfigError,
    DcpSafeError,
    PeerCopyError,
    describe,
)
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest
from dcp_safe.manifest.verify import items_by_file
from dcp_safe.replication.peer_schedule import CopyTransfer, copy_plan, node_leaders
from dcp_safe.replication.peer_transport import PEER_RESTORE, exchange, receive_file, send_file
from dcp_safe.topology import this_node

#: The purpose of the gloo group the peer copies travel on.
PEER_COPIES = "peer-copies"

Report = Callable[[str, BaseException | None], None]

log = logging.getLogger("dcp_safe.manager")


class PeerCopier:
    """Background peer copies of each committed checkpoint's node caches to other nodes.

    Built on every rank at the same point (it forms two gloo groups, their timeout the deadline
    of every peer message, and gathers every rank's node: collectives). Each committed save is
    copied one at a time, in commit order on every rank (the coordinator's verdicts make that
    order the same everywhere), on a thread of its own: neither training nor the next save's
    commit waits for it. A failure is reported (``report``) before the copy's future resolves,
    so a ``wait`` that saw the future done also sees the error; it never touches the committed
    checkpoint. ``copies`` nodes hold each checkpoint (> 1); ``local`` is this node's root,
    ``remote`` the one the checkpoints are committed on; ``keep``: peer copies of this many
    checkpoints are kept on this node after each copy (``None``: all).

    Raises:
        ConfigError: no initialized process group, or fewer nodes than ``copies``.
    """

    def __init__(
        self, *, copies: int, local: Backend, remote: Backend, keep: int | None, deadline_s: float
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"peer_copies={copies} needs a multi-node job: initialize the process group"
                " (torchrun) before building the manager"
            )
        self.group = checkpoint_group(deadline_s, purpose=PEER_COPIES)
        # The group a restore's peer fetches use (a separate stream of messages).
        self.restore_group = checkpoint_group(deadline_s, purpose=PEER_RESTORE)
        self.rank = dist.get_rank(self.group)
        self.nodes: tuple[int, ...] = tuple(gather_objects(this_node(self.rank), self.group))
        node_count = len(set(self.nodes))
        if copies > node_count:
            raise ConfigError(
                f"peer_copies={copies} needs at least {copies} nodes, this job has"
                f" {node_count} (a rank's node is GROUP_RANK, else rank //"
                " LOCAL_WORLD_SIZE): lower peer_copies"
            )
        self.copies = copies
        self.local = local
        self.remote = remote
        self.keep = keep
        # One copy at a time, in commit order, off the manager's thread.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-peer-copies")
        self._broken: BaseException | None = None

    def copy(self, name: str, report: Report) -> Future[list[str]]:
        """Copy ``name``'s node caches to peers in the background (after those queued before).

        ``report(name, error)`` runs first when it is done (``error``: a
        :class:`~dcp_safe.errors.PeerCopyError`, or ``None``); the future then resolves with
        the peer copies committed on this rank (folders relative to ``local``), or that error.
        """
        return self._pool.submit(self._run, name, report)

    def _run(self, name: str, report: Report) -> list[str]:
        error: BaseException | None = None
        try:
            return self._copy(name)
        except BaseException as exc:  # reported and handed to the future, never lost
            error = exc
            raise
        finally:
            try:
                report(name, error)
            except Exception:  # the report is bookkeeping: log it, resolve the future anyway
                log.exception("dcp_safe: reporting the peer copy of %s failed", name)

    def _copy(self, name: str) -> list[str]:
        if self._broken is not None:
            raise PeerCopyError(
                name, {self.rank: f"the peer group failed earlier ({self._broken})"}
            )
        try:
            return self._exchange(name)
        except PeerCopyError:
            raise
        except Exception as exc:
            if is_group_failure(exc):  # a gloo group with a dead member cannot be used again
                self._broken = exc
                discard_group(self.group, destroy=False)
            raise PeerCopyError(name, {self.rank: f"{type(exc).__name__}: {exc}"}) from exc

    def _exchange(self, name: str) -> list[str]:
        """Copy each node's cache of ``name`` into ``copies - 1`` other nodes' (the steps in
        the module docstring); the peer copies committed on this rank.

        Raises:
            PeerCopyError: on every rank, when any copy failed (with each failing rank's reason).
            RuntimeError: the transport's error (a peer died or the deadline passed).
        """
        node = self.nodes[self.rank]
        leads = node_leaders(self.nodes)[node] == self.rank
        offer: list[tuple[str, int]] | None = None
        failed: str | None = None
        if leads:
            try:
                manifest = open_node_cache(self.local, name).manifest
                offer = list(held_files(self.local, name, manifest).items())
            except (DcpSafeError, OSError) as exc:
                failed = f"node {node} offered nothing: {describe(exc)}"
        offers = gather_objects((offer, failed), self.group)
        transfers = copy_plan(self.nodes, [o for o, _ in offers], self.copies)
        receives = [t for t in transfers if t.dst == self.rank]
        send_errors: list[str] = []

        def send_all() -> None:
            for transfer in (t for t in transfers if t.src == self.rank):
                for path, size in transfer.files:
                    rel = f"{name}/{path}"
                    error = send_file(
                        self.group, transfer.dst, self.local, rel, size, tag=transfer.tag
                    )
                    if error is not None:
                        send_errors.append(f"sending {path} to rank {transfer.dst}: {error}")

        def receive_all() -> list[tuple[str, str | None]]:
            raw = _committed_manifest(self.local, self.remote, name) if receives else b""
            return [_receive_copy(name, t, self.group, self.local, raw) for t in receives]

        received = exchange(send_all, receive_all, f"dcp_safe-peer-send-{name}")
        errors = [error for _, error in received if error is not None] + send_errors
        if leads and self.keep is not None:
            try:
                prune_peer_copies(self.local, self.keep)
            except OSError as exc:  # reported with the outcomes: every rank must reach the gather
                errors.append(f"pruning peer copies: {describe(exc)}")
        outcomes = gather_objects("; ".join(errors) or None, self.group)
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
    manifest: Manifest | None = None
    by_file: dict[str, list[ItemRecord]] = {}
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
