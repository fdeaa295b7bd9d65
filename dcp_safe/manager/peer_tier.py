"""The manager's peer tier: each committed checkpoint's node caches copied to other nodes.

Built on every rank at the same point (it creates two gloo groups and gathers every rank's
node, both collectives). Each committed save is copied in the background, one at a time and in
commit order on every rank (the coordinator's verdicts make that order the same everywhere), on
a thread of its own: training never waits for it, and the next save's commit does not either.
A failure is reported (``report``) before the copy's future resolves, so a ``wait`` that saw
the future done also sees the error; it never touches the committed checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.coordination.group import (
    checkpoint_group,
    discard_group,
    gather_objects,
    is_group_failure,
)
from dcp_safe.errors import ConfigError, PeerCopyError
from dcp_safe.reading.peers import PEER_RESTORE
from dcp_safe.replication.peer_copy import PeerGroup, copy_to_peers
from dcp_safe.topology import this_node

log = logging.getLogger("dcp_safe.manager")

PEER_COPIES = "peer-copies"

Report = Callable[[str, BaseException | None], None]


class PeerTier:
    """Background peer copies of committed checkpoints, on every rank.

    Built on every rank at the same point (it forms two groups and gathers every rank's node).

    Args:
        writer: the manager's; its topology's ``peer_copies`` (> 1) say how many nodes hold
            each checkpoint, its backends are this node's root and the commit root, and a
            node-local writer's ``keep_node_caches`` how many checkpoints' peer copies a node
            keeps (``None``: all).

    Raises:
        ConfigError: no initialized process group, or fewer nodes than ``peer_copies``.
    """

    def __init__(self, writer: SafeStorageWriter, deadline_s: float) -> None:
        copies = writer.topology.peer_copies
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"peer_copies={copies} needs a multi-node job: initialize the process group"
                " (torchrun) before building the manager"
            )
        group = checkpoint_group(deadline_s, purpose=PEER_COPIES)
        # The group a restore's peer fetches use (a separate stream of messages).
        self.restore_group = checkpoint_group(deadline_s, purpose=PEER_RESTORE)
        rank = dist.get_rank(group)
        nodes: list[int] = gather_objects(this_node(rank), group)
        self.peers = PeerGroup(group, rank, tuple(nodes))
        if copies > self.peers.node_count:
            raise ConfigError(
                f"peer_copies={copies} needs at least {copies} nodes, this job has"
                f" {self.peers.node_count} (a rank's node is GROUP_RANK, else rank //"
                " LOCAL_WORLD_SIZE): lower peer_copies"
            )
        self.copies, self.local, self.remote = copies, writer.backend, writer.commit_backend
        node_options = getattr(writer, "node_options", None)  # a node-local writer's
        self.keep = None if node_options is None else node_options.keep_node_caches
        # One copy at a time, in commit order, off the manager's thread.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-peer-copies")
        self._broken: BaseException | None = None

    def copy(self, name: str, report: Report) -> Future[list[str]]:
        """Copy ``name``'s node caches to peers in the background (after those queued before).

        ``report(name, error)`` runs first when it is done (``error``: a
        :class:`~dcp_safe.errors.PeerCopyError`, or ``None``); the future then resolves with
        the peer copies committed on this rank, or that error.
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
                name, {self.peers.rank: f"the peer group failed earlier ({self._broken})"}
            )
        try:
            return copy_to_peers(
                name,
                peers=self.peers,
                copies=self.copies,
                local=self.local,
                remote=self.remote,
                keep=self.keep,
            )
        except PeerCopyError:
            raise
        except Exception as exc:
            if is_group_failure(exc):  # a gloo group with a dead member cannot be used again
                self._broken = exc
                discard_group(self.peers.group, destroy=False)
            raise PeerCopyError(name, {self.peers.rank: f"{type(exc).__name__}: {exc}"}) from exc
