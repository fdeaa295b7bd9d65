"""Node-local tiers: every node saves to its own disk, the shared remote holds the checkpoint.

The steps, the node cache, the backpressure and why it is built this way: docs/architecture.md,
"Node caches". :func:`writer_for` is the one place a topology's roles become writer arguments
(the manager and a user of the writer both build their writer there).
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from dcp_safe import layout
from dcp_safe.adapters.without_collectives import Assignment as _Assignment
from dcp_safe.adapters.without_collectives import assignment_of
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.checkpoints.node_cache import prune_node_caches, publish_node_cache, ranks_in
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.coordination.markers import watch_for_commit
from dcp_safe.errors import CommitError, ConfigError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.replication.copying import Copier
from dcp_safe.replication.engine import UploadEngine
from dcp_safe.replication.rank_upload import (
    UploadOptions,
    await_arrivals,
    await_remote_commit,
    upload_rank_part,
)
from dcp_safe.topology import RootLike, Topology


@dataclass(frozen=True, kw_only=True)
class NodeLocalOptions(UploadOptions):
    """How long and how often the background steps of a node-local save wait.

    ``remote_timeout_s`` bounds rank 0's wait for every rank's remote rank manifest; the other
    waits (a rank for the remote commit, a save for the previous upload) are bounded by twice
    it, so that rank 0's verdict reaches every rank first. ``keep_node_caches``: node caches
    kept on each node after a new one is published (the remote is untouched; ``None``: all).
    """

    keep_node_caches: int | None = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_node_caches is not None and self.keep_node_caches < 1:
            raise ConfigError(f"keep_node_caches must be >= 1, got {self.keep_node_caches}")


class NodeLocalWriter(SafeStorageWriter):
    """A ``SafeStorageWriter`` for node-local roots that commits only on the shared ``remote``.

    Every rank passes its own node's ``root`` (the same ``remote`` everywhere), or a
    :class:`~dcp_safe.topology.Topology` with a node cache (``Topology.of(remote,
    node_local=root)``), which it keeps as its own, as ``writer_for`` builds it. The DCP call
    order is the base class's, but ``finish`` publishes nothing locally: the checkpoint exists
    once the remote ``_COMMITTED`` does. Wait for that with :meth:`replication` (on every rank).

    Args:
        remote: the shared root every rank uploads to, with ``storage_options``, or a ``Root``;
            not given with a ``Topology``, nor is ``peer_copies``.
        peer_copies: the topology's peer tier; the manager copies node caches to other nodes,
            this writer only counts their buffers.
        **kwargs: the other :class:`SafeStorageWriter` options (``options.overwrite`` is
            refused: a remote name is never replaced).

    Raises:
        ConfigError: ``root`` is not a local directory; ``options.overwrite`` or
            ``replicate_to``; a ``Topology`` with ``remote`` or without a node cache; at save
            time, ``use_collectives=False`` (node-local roots share no storage to agree on).
    """

    _node_local = True

    def __init__(
        self,
        root: str | os.PathLike[str] | Topology,
        *,
        remote: RootLike | None = None,
        node_options: NodeLocalOptions | None = None,
        peer_copies: int = 1,
        **kwargs: Any,
    ) -> None:
        overwrite = getattr(kwargs.get("options"), "overwrite", False)
        if overwrite or kwargs.get("replicate_to") is not None:
            raise ConfigError("NodeLocalWriter takes neither overwrite nor replicate_to")
        if not isinstance(root, Topology):
            if remote is None:
                raise ConfigError("NodeLocalWriter needs remote=, the shared root")
            options = kwargs.pop("storage_options", None)
            root = Topology.of(
                remote, node_local=root, storage_options=options, peer_copies=peer_copies
            )
        elif (remote, peer_copies) != (None, 1):
            raise ConfigError(
                "a Topology root names the remote, its options and peer_copies: give them to"
                " Topology.of, not to the writer"
            )
        super().__init__(root, **kwargs)
        strategy_for(self.backend).require_rename(
            f"a node-local root must be a local directory, got {self.root}"
        )
        assert self.remote is not None  # a node cache's topology uploads to its commit root
        self.commit_backend = self.remote
        self.node_options = node_options or NodeLocalOptions()

    # ----------------------------------------------------------------- DCP call order

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Assign the save (base class), then take the remote name for it."""
        plans = super().prepare_global_plan(plans)
        assignment = assignment_of(plans[0])
        try:
            # The fence and the claim that matter are on the shared root, the only one all see.
            self._claim_on(self.commit_backend, assignment.save_id)
        except BaseException:
            with contextlib.suppress(OSError):
                self.backend.remove_tree(assignment.work_dir)
            raise
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        """Write this rank's files on its node (base class), then upload them in the background."""
        assignment = assignment_of(plan)
        # Only the coordinator's node got the work directory from prepare_global_plan.
        self.backend.makedirs(f"{assignment.work_dir}/{layout.RANKS_DIR}")
        # At most one upload in flight per rank: a slow remote slows saves down (DCP's
        # write_data runs in the background for async_save) instead of piling them up
        # (ReplicationTimeoutError if the previous one is still running at the deadline).
        self._uploads.wait(2 * self.node_options.remote_timeout_s)
        # A failed write is reported to the ranks waiting on the remote by the base class.
        return super().write_data(plan, planner)

    def _replicate_rank_part(self, assignment: _Assignment) -> None:
        """This rank's files are written on its node: upload them in the background."""
        name = self._require_name()
        self._uploads.start(name, functools.partial(self._upload_and_publish, name, assignment))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Start the remote commit in the background (coordinator only); publishes nothing here."""
        assignment, name = self._require_assignment(), self._require_name()
        commit = functools.partial(self._commit_remote, name, assignment, metadata, results)
        self._commits.start(name, commit)

    def replication(self, name: str, *, poll_s: float = 0.5) -> Future[Any]:
        """A future that resolves once ``name`` is committed on the remote (and, on the rank that
        publishes it, once this node's cache is published); it fails with the cause otherwise.
        Outside the process that ran ``write_data`` it watches the remote marker."""
        name = layout.validate_name(name)
        with contextlib.suppress(KeyError):
            return self._uploads.future(name)
        timeout_s = 2 * self.node_options.remote_timeout_s
        return watch_for_commit(self.commit_backend, name, poll_s=poll_s, timeout_s=timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (bounded by ``timeout_s`` each) for this writer's uploads and remote commits;
        raise the first failure.

        Raises:
            ReplicationTimeoutError: still running after ``timeout_s`` seconds.
            BaseException: the first failed upload or remote commit, as it was raised.
        """
        for engine in (self._commits, self._uploads):
            engine.wait(timeout_s)
        for future in [*self._commits.futures(), *self._uploads.futures()]:
            future.result()

    _ENGINES = ("_uploads", "_commits")

    def _start_engines(self) -> None:
        """Its uploads and remote commits, a thread per job (docs/architecture.md, "The upload
        engine"), instead of the base class's replicators."""
        assert self.remote is not None
        self._replicator = self._rank_replicator = None
        url = self.remote.url
        self._uploads = UploadEngine(f"node-local uploads to {url}", thread_name="dcp_safe-node")
        self._commits = UploadEngine(f"remote commits on {url}", thread_name="dcp_safe-commit")

    # ----------------------------------------------------------------- background work

    def _upload_and_publish(self, name: str, assignment: _Assignment) -> Manifest:
        """Copy this rank's files to the remote, verified in flight, its rank manifest last; once
        the remote commit is there, the node's leader publishes the node cache."""
        work = self._remote_work(assignment, name)
        with self._failure_reported(assignment, rank=assignment.rank, name=name):
            self._upload_rank(assignment, work)
        manifest = self._await_remote_commit(name, assignment, work)
        # The leader is the lowest rank that wrote into this node's work directory: every rank
        # of the node wrote its local rank manifest by now; none listed means the leader
        # already renamed the directory into place.
        ranks = ranks_in(self.backend, assignment.work_dir)
        if ranks and assignment.rank == min(ranks):
            publish_node_cache(
                self.backend, self.commit_backend, assignment.work_dir, name, manifest
            )
            if self.node_options.keep_node_caches is not None:
                prune_node_caches(self.backend, self.node_options.keep_node_caches)
        return manifest

    def _upload_rank(self, assignment: _Assignment, work: str) -> None:
        # A failed save's objects stay, under its lease, for the sweeper: no clean-up here.
        chunk_bytes, remote = self.node_options.chunk_bytes, self.commit_backend
        copier = Copier(self.backend, remote, chunk_bytes=chunk_bytes, retry=self.retry)
        upload_rank_part(copier, assignment.work_dir, work, assignment.rank)

    def _commit_remote(
        self,
        name: str,
        assignment: _Assignment,
        metadata: Metadata,
        results: list[list[WriteResult]],
    ) -> Manifest:
        remote, work = self.commit_backend, self._remote_work(assignment, name)
        with self._failure_reported(assignment, rank=None, name=name):
            await_arrivals(
                remote, work, assignment.save_id, name, assignment.world_size, self.node_options
            )
        return self._publish(assignment, metadata, results, remote, name)

    def _await_remote_commit(self, name: str, assignment: _Assignment, work: str) -> Manifest:
        def own_commit(wait_s: float = 0.0) -> None:
            try:
                commit = self._commits.future(name)
            except KeyError:
                return  # not rank 0
            wait([commit], timeout=wait_s)
            if commit.done() and commit.exception() is not None:
                commit.result()  # rank 0 in this very process: its original error

        try:
            return await_remote_commit(
                self.commit_backend,
                name,
                work,
                assignment.save_id,
                self.node_options,
                before=own_commit,
            )
        except CommitError:
            # Rank 0 writes its failure marker just before its own future fails, so this poll
            # can read the marker first; rank 0's own error (an UploadTimeoutError naming the
            # late rank, say) is the more exact one.
            own_commit(self.node_options.remote_timeout_s)
            raise


def writer_for(
    topology: Topology, *, remote_timeout_s: float | None = None, **kwargs: Any
) -> SafeStorageWriter:
    """A :class:`SafeStorageWriter` of ``topology``'s commit root (and its replica), or, with a
    node cache, a :class:`NodeLocalWriter` that writes there and uploads to the commit root.
    The writer keeps ``topology`` itself as its ``topology``.

    ``remote_timeout_s`` bounds the per-rank uploads' waits (default: the upload options');
    ``kwargs``: the other :class:`SafeStorageWriter` arguments, not the roots.
    """
    bound: dict[str, Any] = (
        {} if remote_timeout_s is None else {"remote_timeout_s": remote_timeout_s}
    )
    if topology.node_cache is None:
        return SafeStorageWriter(topology, replication_options=UploadOptions(**bound), **kwargs)
    return NodeLocalWriter(topology, node_options=NodeLocalOptions(**bound), **kwargs)
