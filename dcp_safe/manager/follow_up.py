"""What follows a local commit: verify it, record it, replicate it, then let retention prune.

Runs on the manager thread (asynchronous saves) or the caller's (synchronous ones). A checkpoint
that fails verification is not trusted: no replication, no pruning behind it, the save fails.
A retention failure does not fail the save; it is kept for ``wait``/``close``. ``committed``
resolves last, ``replicated`` once the replica's outcome is recorded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.coordination.store import Verdicts
from dcp_safe.errors import DcpSafeError, ReplicationSkippedError
from dcp_safe.manager.fallback import FallbackSwitch
from dcp_safe.manager.handles import SaveHandle
from dcp_safe.manager.in_memory import InMemoryTier
from dcp_safe.manager.ledger import Ledger, SaveSpans
from dcp_safe.manager.peer_tier import PeerTier
from dcp_safe.manager.tiers import Tiers
from dcp_safe.worker.parent import SaveWorker
from dcp_safe.worker.transport import decode_error

__all__ = ["FollowUp"]

log = logging.getLogger("dcp_safe.manager")


@dataclass(kw_only=True, eq=False)
class FollowUp:
    """The steps after a local commit, over the manager's parts.

    Args:
        deep: verify every byte (``validate="deep"``) rather than marker and manifest.
        flush_s: the longest a commit waits for its history event to be written.
        verdicts: the coordinator's verdicts (``None``: one process, its own check decides).
    """

    tiers: Tiers
    ledger: Ledger
    switch: FallbackSwitch
    spans: SaveSpans
    deep: bool
    flush_s: float
    verdicts: Verdicts | None = None
    in_memory: InMemoryTier | None = None  # keep_in_memory=True
    has_worker: bool = False  # saves run in a worker process once it is ready

    def after_upload(
        self,
        handle: SaveHandle,
        upload: Future[Any],
        writer: SafeStorageWriter,
        worker: SaveWorker | None = None,
    ) -> None:
        """An asynchronous save's upload ended: fail the handle, or follow its commit up.

        ``worker``: the process executor's, which replicated and checked the save (its futures
        and check are taken from it rather than from ``writer`` and :class:`Tiers`)."""
        try:
            error = upload.exception()
            if error is not None and self.verdicts is None:
                self.ledger.fail(handle, error, tier="local")
            else:
                self.after_commit(handle, writer, error, worker)
        except BaseException as exc:  # a bug here must not leave the handle unresolved
            self.ledger.fail(handle, exc, tier="local")

    def after_commit(
        self,
        handle: SaveHandle,
        writer: SafeStorageWriter,
        error: BaseException | None = None,
        worker: SaveWorker | None = None,
    ) -> None:
        """``handle`` committed locally through ``writer`` (or failed with ``error``, which in a
        multi-rank job the coordinator's verdict may overrule: see :mod:`.verdicts`)."""
        failure = (error, None) if error is not None else self._check(handle, writer, worker)
        if self.verdicts is not None:
            key = self.verdicts.key_for(handle.name)
            if self.verdicts.coordinator:
                self.verdicts.post(key, failure and failure[0])
            else:  # the coordinator's verdict decides; this rank's own error says it best
                verdict = self.verdicts.await_verdict(key)
                if verdict is None:
                    failure = None
                elif failure is None:
                    failure = (verdict, str(verdict))
        if failure is not None:
            # Neither pruning nor a replication future: the newest checkpoint is not trusted.
            self.ledger.fail(handle, failure[0], tier="local", reason=failure[1])
            return
        self.ledger.count("committed")
        if (peers := self.tiers.peers) is not None:  # every rank, in the same order of saves
            self._copy_to_peers(handle, peers)
        self.ledger.record("committed", handle, tier="local", validated=True)
        if (tier := self.in_memory) is not None:  # before ``committed``: a rollback may follow
            self.ledger.quietly("in-memory tier", lambda: _keep(tier, handle))
        # On a thread while the worker starts: not counted by the fallback (a start-up).
        self.switch.on_committed(handle, counted=worker is not None or not self.has_worker)
        self._replicate(handle, writer, (worker or writer).replication)
        try:
            self.tiers.prune()
        except (DcpSafeError, OSError) as exc:  # the save itself succeeded: keep, do not fail it
            log.warning("retention after %s failed: %s", handle.name, exc)
            self.ledger.keep(exc)
        # A caller that reads the history once ``committed`` resolves finds the event there.
        self.ledger.books.flush(self.flush_s)
        with contextlib.suppress(InvalidStateError):  # resolved by a close that gave up on it
            handle.committed.set_result(handle.name)
        self.ledger.quietly("telemetry", lambda: self.spans.end(handle, None))

    def _check(
        self,
        handle: SaveHandle,
        writer: SafeStorageWriter,
        worker: SaveWorker | None = None,
    ) -> tuple[BaseException, str] | None:
        """Wait for the commit (node-local) and check the checkpoint; why it is not trusted."""
        try:
            self.tiers.await_commit(handle.name, writer, (worker or writer).replication)
        except (DcpSafeError, OSError) as exc:
            return exc, f"remote commit failed: {exc}"
        try:
            checked = None if worker is None else worker.checked(handle.name)
            if checked is None:
                self.tiers.verify(handle.name, deep=self.deep)
            elif checked.error is not None:
                raise decode_error(checked.error)
            else:
                self.tiers.trust(handle.name)
        except (DcpSafeError, OSError) as exc:
            return exc, f"verification failed: {exc}"
        return None

    def _replicate(
        self,
        handle: SaveHandle,
        writer: SafeStorageWriter,
        replication: Callable[[str], Future[Any]],
    ) -> None:
        if writer.topology.replica is None:  # a node-local save is uploaded before it counts
            handle.replicated.set_result(None)
            return
        remote = replication(handle.name)
        self.tiers.track_replication(handle.name, handle.replicated)
        remote.add_done_callback(lambda done: self._replicated(handle, done))

    def _copy_to_peers(self, handle: SaveHandle, peers: PeerTier) -> None:
        """Copy the node caches to peers in the background; ``wait``/``close`` wait for it and
        raise its failure (counted, never failing the committed save)."""

        def report(name: str, error: BaseException | None) -> None:
            if error is None:
                self.ledger.count("peer_copies")
                return
            log.warning("peer copies of %s failed: %s", name, error)
            self.ledger.count("peer_copy_failures")
            self.ledger.keep(error)

        future = peers.copy(handle.name, report)
        self.tiers.track_replication(handle.name, future)
        future.add_done_callback(lambda done: self.tiers.replication_done(handle.name, done))

    def _replicated(self, handle: SaveHandle, done: Future[Any]) -> None:
        if handle.replicated.done():
            return
        error = done.exception()
        if error is None:
            self.ledger.record("committed", handle, tier="remote")
            with contextlib.suppress(InvalidStateError):
                handle.replicated.set_result(done.result())
        elif isinstance(error, ReplicationSkippedError):  # policy, not a failure
            self.ledger.record("skipped", handle, tier="remote", reason=str(error))
            handle.replicated.set_exception(error)
        else:
            self.ledger.fail(handle, error, tier="remote", future=handle.replicated)
        self.tiers.replication_done(handle.name, handle.replicated)


def _keep(tier: InMemoryTier, handle: SaveHandle) -> None:
    try:
        tier.committed(handle)
    except BaseException:
        tier.forget()  # an older copy must not pass for the last committed step
        raise
