"""Node-local tiers: every node saves to its own disk, the shared remote holds the checkpoint.

On a multi-node job each node has fast local storage (NVMe) that the other nodes cannot see,
and one shared remote root (S3). :class:`NodeLocalWriter` saves there like this (``R`` is a
rank, ``W`` the remote work location: ``<name>/`` on an object store, a hidden partial
directory on storage that renames atomically)::

    every rank   write_data      its shard files and rank manifest into the hidden partial
                                 directory ``.<name>.partial-<id>/`` on its node's local root
    every rank   (background)    uploads its own files to W, checksums recomputed in flight,
                                 then its rank manifest W/_ranks/rank_R.json, last: "arrived"
    rank 0       finish          returns at once; (background) waits, bounded, until every
                                 rank's remote rank manifest exists, then verifies and
                                 publishes W exactly as a one-root save does (.metadata,
                                 manifest.json, and _COMMITTED last, via the Committer)
    every rank   (background)    waits, bounded, for the remote _COMMITTED; then the lowest
                                 rank on each node publishes the node cache (below)

All coordination after ``write_data`` goes through storage markers, never through the training
process group, so a slow remote never blocks a collective. A rank whose write or upload fails
writes ``W/_ranks/rank_R.failed-<save id>``: every rank waiting in the background sees it and
fails at once with :class:`~dcp_safe.errors.CommitError` naming that rank, and rank 0 publishes
nothing (a failed remote commit on rank 0 writes ``W/_FAILED-<save id>``, which ends the others'
waits the same way). The save id in these names keeps a stale marker from ever touching a later
save of that name. A failed save's remote objects stay, under their writing lease, for the
sweeper to collect after its grace period; a rank killed outright is noticed at the deadline.

What the node-local tier is: a **node cache**, never a checkpoint (the layout is
:mod:`dcp_safe.checkpoints.node_cache`'s). Once the remote commit exists, each node's files are
renamed into ``<local root>/<name>/`` with the remote ``manifest.json`` and ``.metadata`` and a
``_NODE_COMMITTED`` marker. It holds only the shard files its node's ranks wrote, so it carries
no ``_COMMITTED``: ``list_checkpoints``, ``SafeStorageReader`` and ``"latest"`` never see it as
a checkpoint, and the remote root is the only complete copy (restore from it on any number of
ranks or nodes). ``list_node_caches`` lists the caches, for an operator or for a same-topology
restart that wants to know what is local; the publishing rank keeps the newest
``keep_node_caches`` of them. A save that fails leaves only hidden partial directories locally,
which the sweeper collects after its grace period.

Backpressure: at most one upload in flight per rank. ``write_data`` of the next save first
waits (bounded) for this rank's previous upload, so a slow remote slows saves down (in the
background, for ``async_save``) instead of piling uploads up.

Why this design: the alternative, rank 0 copying a committed local checkpoint (what
:class:`~dcp_safe.replication.replicator.Replicator` does for one shared local root), cannot work
when no node sees every file; and committing each node's subset locally as if it were a
checkpoint would let a reader restore half a model. Uploading per rank also spreads the upload
bandwidth over every node.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.retry import call_with_retries
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.node_cache import prune_node_caches, publish_node_cache, ranks_in
from dcp_safe.checkpoints.watch import poll_until, watch_for_commit
from dcp_safe.commit.committer import Committer
from dcp_safe.commit.fencing import check_fence, register_attempt
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.dcp.writer import SafeStorageWriter, _Assignment
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    ReplicationTimeoutError,
)
from dcp_safe.manifest.schema import Manifest, RankManifest
from dcp_safe.replication.replicator import DEFAULT_CHUNK_BYTES, copy_file_verified

__all__ = ["NodeLocalOptions", "NodeLocalWriter"]

_FAILED_PREFIX = "_FAILED-"
_KEEP_DONE = 16  # finished futures kept for replication()


@dataclass(frozen=True, kw_only=True)
class NodeLocalOptions:
    """How long and how often the background steps of a node-local save wait.

    Args:
        remote_timeout_s: how long rank 0 waits for every rank's remote rank manifest. The
            other waits are bounded by twice this (a rank for the remote commit, a save for
            the previous upload), so that rank 0's verdict, with its cause, reaches every rank
            before they give up on their own.
        poll_s: pause between polls of the remote markers.
        chunk_bytes: bytes read and uploaded at a time, per file.
        keep_node_caches: node caches kept on each node after a new one is published (the
            older ones are removed; the remote tier is untouched). ``None`` keeps them all.
    """

    remote_timeout_s: float = 1800.0
    poll_s: float = 0.5
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    keep_node_caches: int | None = 2

    def __post_init__(self) -> None:
        if self.remote_timeout_s <= 0 or self.poll_s <= 0 or self.chunk_bytes < 1:
            raise ConfigError(
                "remote_timeout_s, poll_s and chunk_bytes must be positive, got "
                f"{self.remote_timeout_s}, {self.poll_s}, {self.chunk_bytes}"
            )
        if self.keep_node_caches is not None and self.keep_node_caches < 1:
            raise ConfigError(f"keep_node_caches must be >= 1, got {self.keep_node_caches}")


class NodeLocalWriter(SafeStorageWriter):
    """A ``SafeStorageWriter`` for node-local roots that commits only on the shared ``remote``.

    Every rank passes its own node's ``root`` (the same ``remote`` everywhere). The DCP call
    order is the base class's; what differs is in the module docstring: ``finish`` publishes
    nothing locally, and the checkpoint exists once the remote ``_COMMITTED`` does. Wait for
    that with :meth:`replication` (on every rank) before relying on it.

    Args:
        root: this node's local directory.
        remote: the shared root every rank uploads to (``s3://...`` or a shared directory).
        remote_storage_options: fsspec options for ``remote`` (default: ``storage_options``).
        node_options: waits and chunk size of the background steps.
        **kwargs: the other :class:`SafeStorageWriter` options (``overwrite`` is refused: a
            remote name is never replaced).

    Raises:
        ConfigError: ``root`` cannot rename atomically (it must be a local directory), or
            ``overwrite``/``replicate_to`` was given.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        remote: str | os.PathLike[str],
        remote_storage_options: dict[str, Any] | None = None,
        node_options: NodeLocalOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("overwrite") or kwargs.get("replicate_to") is not None:
            raise ConfigError("NodeLocalWriter takes neither overwrite nor replicate_to")
        super().__init__(
            root, replicate_to=remote, replicate_storage_options=remote_storage_options, **kwargs
        )
        if self.strategy.in_place:
            raise ConfigError(f"a node-local root must be a local directory, got {self.root}")
        self.node_options = node_options or NodeLocalOptions()
        self._uploads: dict[str, Future[Manifest]] = {}
        self._commits: dict[str, Future[Manifest]] = {}

    @property
    def remote_backend(self) -> Backend:
        if self.remote is None:  # set by the base class from replicate_to
            raise ConfigError("NodeLocalWriter has no remote")
        return self.remote

    # ----------------------------------------------------------------- DCP call order

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Assign the save (base class), then take the remote name for it."""
        plans = super().prepare_global_plan(plans)
        assignment = _assignment_of(plans[0])
        name = self._require_name()
        remote = self.remote_backend
        try:
            if self.attempt is not None:
                # The fence that matters is on the shared root, the only one every node sees.
                register_attempt(remote, self.attempt)
                check_fence(remote, self.attempt)
            strategy = strategy_for(remote)
            strategy.claim(remote, name, assignment.save_id)
            if not strategy.in_place and remote.exists(f"{name}/{layout.COMMITTED_MARKER}"):
                raise CheckpointExistsError(remote.full_path(name))  # refused before uploading
            remote.makedirs(
                f"{_remote_work_dir(remote, name, assignment.save_id)}/{layout.RANKS_DIR}"
            )
        except BaseException:
            with contextlib.suppress(OSError):
                self.backend.remove_tree(assignment.work_dir)
            raise
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        """Write this rank's files on its node (base class), then upload them in the background."""
        assignment = _assignment_of(plan)
        # Only the coordinator's node got the work directory from prepare_global_plan.
        self.backend.makedirs(f"{assignment.work_dir}/{layout.RANKS_DIR}")
        self._wait_for_previous_upload()
        try:
            written = super().write_data(plan, planner)
        except BaseException as exc:
            # DCP fails the save everywhere, but the ranks that wrote fine already wait in the
            # background for a remote commit that will never come: tell them through storage.
            self._report_rank_failure(assignment, exc)
            raise
        self._start(self._uploads, self._upload_and_publish, self._require_name(), assignment)
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Start the remote commit in the background (coordinator only); publishes nothing here."""
        assignment = self._assignment
        if assignment is None:
            raise ConfigError("finish() called before write_data()")
        name = self._require_name()
        self._start(self._commits, self._commit_remote, name, assignment, metadata, results)

    def replication(self, name: str, *, poll_s: float = 0.5) -> Future[Any]:
        """A future that resolves once ``name`` is committed on the remote (and, on the rank that
        publishes it, once this node's cache is published); it fails with the cause otherwise.

        In the process that ran ``write_data`` it is that rank's own background work; elsewhere
        (DCP's checkpoint process did the work) it watches the remote marker.
        """
        name = layout.validate_name(name)
        if name in self._uploads:
            return self._uploads[name]
        return watch_for_commit(
            self.remote_backend,
            name,
            poll_s=poll_s,
            timeout_s=2 * self.node_options.remote_timeout_s,
        )

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) for this writer's background work; raise its first failure.

        Raises:
            ReplicationTimeoutError: still running after ``timeout_s`` seconds.
            BaseException: the first failed upload or remote commit, as it was raised.
        """
        futures = [*self._commits.values(), *self._uploads.values()]
        _, running = wait(futures, timeout=timeout_s)
        if running:
            raise ReplicationTimeoutError(
                f"{len(running)} node-local uploads or commits still running after {timeout_s} s"
            )
        for future in futures:
            future.result()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_uploads"], state["_commits"] = {}, {}  # futures of this process's threads
        return state

    # ----------------------------------------------------------------- background work

    def _wait_for_previous_upload(self) -> None:
        """At most one upload in flight per rank: a slow remote slows saves down (DCP's
        ``write_data`` runs in the background for ``async_save``) instead of piling them up.

        Raises:
            ReplicationTimeoutError: the previous upload is still running at the deadline.
        """
        running = [f for f in self._uploads.values() if not f.done()]
        _, still = wait(running, timeout=2 * self.node_options.remote_timeout_s)
        if still:
            raise ReplicationTimeoutError(
                f"the previous upload to {self.remote_backend.url} is still running after "
                f"{2 * self.node_options.remote_timeout_s} s"
            )

    def _start(self, registry: dict[str, Future[Manifest]], target: Any, *args: Any) -> None:
        future: Future[Manifest] = Future()
        registry.pop(args[0], None)
        registry[args[0]] = future
        finished = [name for name, f in registry.items() if f.done()]
        for name in finished[: max(0, len(finished) - _KEEP_DONE)]:
            del registry[name]  # a long run keeps only the newest outcomes

        def run() -> None:
            try:
                future.set_result(target(*args))
            except BaseException as exc:  # the owner decides what is fatal; it reaches the future
                future.set_exception(exc)

        threading.Thread(target=run, name=f"dcp_safe-node-{args[0]}", daemon=True).start()

    def _upload_and_publish(self, name: str, assignment: _Assignment) -> Manifest:
        work = _remote_work_dir(self.remote_backend, name, assignment.save_id)
        try:
            self._upload_rank(assignment, work)
        except BaseException as exc:
            self._report_rank_failure(assignment, exc)
            raise
        manifest = self._await_remote_commit(name, assignment, work)
        if self._leads_node(assignment):
            publish_node_cache(
                self.backend, self.remote_backend, assignment.work_dir, name, manifest
            )
            if self.node_options.keep_node_caches is not None:
                prune_node_caches(self.backend, self.node_options.keep_node_caches)
        return manifest

    def _upload_rank(self, assignment: _Assignment, work: str) -> None:
        """Copy this rank's files to the remote, verified in flight; its rank manifest last."""
        rel = layout.rank_manifest_name(assignment.rank)
        local_rel = f"{assignment.work_dir}/{rel}"
        raw = self.backend.read_bytes(local_rel)
        manifest = RankManifest.from_json(raw, self.backend.full_path(local_rel))
        remote = self.remote_backend
        for record in manifest.files:
            items = [item for item in manifest.items if item.file == record.path]
            copy = functools.partial(
                copy_file_verified,
                self.backend,
                f"{assignment.work_dir}/{record.path}",
                remote,
                f"{work}/{record.path}",
                record,
                items,
                chunk_bytes=self.node_options.chunk_bytes,
            )
            call_with_retries("upload", remote.full_path(f"{work}/{record.path}"), copy, self.retry)
        remote.write_bytes(f"{work}/{rel}", raw)

    def _commit_remote(
        self,
        name: str,
        assignment: _Assignment,
        metadata: Metadata,
        results: list[list[WriteResult]],
    ) -> Manifest:
        remote = self.remote_backend
        work = _remote_work_dir(remote, name, assignment.save_id)
        try:
            poll_until(
                lambda: self._every_rank_arrived(work, assignment),
                timeout_s=self.node_options.remote_timeout_s,
                poll_s=self.node_options.poll_s,
                waiting_for=f"every rank's manifest under {remote.full_path(work)}",
            )
            return Committer(remote, self.options).publish(
                name=name,
                save_id=assignment.save_id,
                work_dir=work,
                world_size=assignment.world_size,
                step=self.step,
                metadata=metadata,
                results=results,
                attempt=self.attempt,
            )
        except BaseException as exc:
            _write_failure(remote, f"{work}/{_FAILED_PREFIX}{assignment.save_id}", exc)
            raise

    def _report_rank_failure(self, assignment: _Assignment, exc: BaseException) -> None:
        work = _remote_work_dir(self.remote_backend, self._require_name(), assignment.save_id)
        failed = f"{work}/{layout.RANKS_DIR}/{_rank_failed_name(assignment)}"
        _write_failure(self.remote_backend, failed, exc)

    def _raise_rank_failures(self, work: str, save_id: str, present: set[str]) -> None:
        """Raise CommitError naming every rank that reported a failure of this save."""
        suffix = f".failed-{save_id}"
        failed = sorted(entry for entry in present if entry.endswith(suffix))
        if failed:
            ranks_dir = f"{work}/{layout.RANKS_DIR}"
            raise CommitError(
                "ranks failed to write or upload their part; nothing was published",
                {
                    int(entry[5:10]): _read_text(self.remote_backend, f"{ranks_dir}/{entry}")
                    for entry in failed
                },
            )

    def _every_rank_arrived(self, work: str, assignment: _Assignment) -> bool | None:
        """True once every rank's remote rank manifest exists; raises on a rank's failure."""
        present = set(self.remote_backend.list_dir(f"{work}/{layout.RANKS_DIR}"))
        self._raise_rank_failures(work, assignment.save_id, present)
        expected = {
            layout.rank_manifest_name(r).split("/")[-1] for r in range(assignment.world_size)
        }
        return True if expected <= present else None

    def _await_remote_commit(self, name: str, assignment: _Assignment, work: str) -> Manifest:
        remote = self.remote_backend
        failed_marker = f"{work}/{_FAILED_PREFIX}{assignment.save_id}"

        def committed() -> Manifest | None:
            commit = self._commits.get(name)
            if commit is not None and commit.done() and commit.exception() is not None:
                commit.result()  # rank 0 in this very process: its original error
            try:
                manifest = open_committed(remote, name).manifest
            except (CheckpointNotFoundError, CheckpointCorruptError, OSError):
                manifest = None  # not there yet, or half-visible on an eventually consistent store
            if manifest is not None:
                if manifest.save_id != assignment.save_id:
                    raise CheckpointExistsError(remote.full_path(name), "another save committed it")
                return manifest
            if remote.exists(failed_marker):
                raise CommitError(
                    "the remote commit failed; nothing was published",
                    {0: _read_text(remote, failed_marker)},
                )
            # A rank whose write_data failed: rank 0 never gets finish() and cannot say so.
            present = set(remote.list_dir(f"{work}/{layout.RANKS_DIR}"))
            self._raise_rank_failures(work, assignment.save_id, present)
            return None

        return poll_until(
            committed,
            timeout_s=2 * self.node_options.remote_timeout_s,
            poll_s=self.node_options.poll_s,
            waiting_for=f"{remote.full_path(name)}/{layout.COMMITTED_MARKER}",
        )

    def _leads_node(self, assignment: _Assignment) -> bool:
        """True on the lowest rank that wrote into this node's work directory.

        Called after the remote commit, when every rank of the node has written its local rank
        manifest; an empty listing means the leader already renamed the directory into place.
        """
        ranks = ranks_in(self.backend, assignment.work_dir)
        return bool(ranks) and assignment.rank == min(ranks)


# --------------------------------------------------------------------- helpers


def _assignment_of(plan: SavePlan) -> _Assignment:
    assignment = plan.storage_data
    if not isinstance(assignment, _Assignment):
        raise ConfigError("NodeLocalWriter got a plan it did not prepare")
    return assignment


def _remote_work_dir(remote: Backend, name: str, save_id: str) -> str:
    """Where every rank uploads: decided by the remote's flags, the same on every rank."""
    return strategy_for(remote).work_dir(name, save_id)


def _rank_failed_name(assignment: _Assignment) -> str:
    return f"rank_{assignment.rank:05d}.failed-{assignment.save_id}"


def _write_failure(remote: Backend, rel: str, exc: BaseException) -> None:
    """Best effort: tell the peers through storage; the caller re-raises ``exc`` regardless."""
    with contextlib.suppress(Exception):
        remote.write_bytes(rel, f"{type(exc).__name__}: {exc}".encode())


def _read_text(backend: Backend, rel: str) -> str:
    return backend.read_bytes(rel).decode("utf-8", errors="replace").strip()
