"""What follows a local commit: verify it, record it, replicate it, then let retention prune.

Runs on the manager thread (asynchronous saves) or the caller's (synchronous ones). A checkpoint
that fails verification is not trusted: no replication, no pruning behind it, the save fails.
A retention failure does not fail the save; it is kept for ``wait``/``close``. ``committed``
resolves last, ``replicated`` once the replica's outcome is recorded.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, InvalidStateError
from typing import Any

from dcp_safe.dcp.writer import SafeStorageWriter
from dcp_safe.errors import DcpSafeError, ReplicationSkippedError
from dcp_safe.manager.handles import SaveHandle
from dcp_safe.manager.ledger import Ledger
from dcp_safe.manager.spans import SaveSpans
from dcp_safe.manager.switch import FallbackSwitch
from dcp_safe.manager.tiers import Tiers
from dcp_safe.manager.verdicts import Verdicts

__all__ = ["FollowUp"]

log = logging.getLogger("dcp_safe.manager")


class FollowUp:
    """The steps after a local commit, over the manager's parts.

    Args:
        deep: verify every byte (``validate="deep"``) rather than marker and manifest.
        flush_s: the longest a commit waits for its history event to be written.
        verdicts: the coordinator's verdicts (``None``: one process, its own check decides).
    """

    def __init__(
        self,
        *,
        tiers: Tiers,
        ledger: Ledger,
        switch: FallbackSwitch,
        spans: SaveSpans,
        deep: bool,
        flush_s: float,
        verdicts: Verdicts | None = None,
    ) -> None:
        self._flush_s = flush_s
        self._verdicts = verdicts
        self._tiers = tiers
        self._ledger = ledger
        self._switch = switch
        self._spans = spans
        self._deep = deep

    def after_upload(
        self, handle: SaveHandle, upload: Future[Any], writer: SafeStorageWriter
    ) -> None:
        """An asynchronous save's upload ended: fail the handle, or follow its commit up."""
        try:
            error = upload.exception()
            if error is not None and self._verdicts is None:
                self._ledger.fail(handle, error, tier="local")
            else:
                self.after_commit(handle, writer, error)
        except BaseException as exc:  # a bug here must not leave the handle unresolved
            self._ledger.fail(handle, exc, tier="local")

    def after_commit(
        self, handle: SaveHandle, writer: SafeStorageWriter, error: BaseException | None = None
    ) -> None:
        """``handle`` committed locally through ``writer`` (or failed with ``error``, which in a
        multi-rank job the coordinator's verdict may overrule: see :mod:`.verdicts`)."""
        failure = (error, None) if error is not None else self._check(handle, writer)
        if self._verdicts is not None:
            key = self._verdicts.key_for(handle.name)
            if self._verdicts.coordinator:
                self._verdicts.post(key, failure and failure[0])
            else:  # the coordinator's verdict decides; this rank's own error says it best
                verdict = self._verdicts.await_verdict(key)
                if verdict is None:
                    failure = None
                elif failure is None:
                    failure = (verdict, str(verdict))
        if failure is not None:
            # Neither pruning nor a replication future: the newest checkpoint is not trusted.
            self._ledger.fail(handle, failure[0], tier="local", reason=failure[1])
            return
        self._ledger.count("committed")
        self._ledger.record("committed", handle, tier="local", validated=True)
        self._switch.on_committed(handle)
        self._replicate(handle, writer)
        try:
            self._tiers.prune()
        except (DcpSafeError, OSError) as exc:  # the save itself succeeded: keep, do not fail it
            log.warning("retention after %s failed: %s", handle.name, exc)
            self._ledger.keep(exc)
        # A caller that reads the history once ``committed`` resolves finds the event there.
        self._ledger.books.flush(self._flush_s)
        with contextlib.suppress(InvalidStateError):  # resolved by a close that gave up on it
            handle.committed.set_result(handle.name)
        self._ledger.quietly("telemetry", lambda: self._spans.end(handle, None))

    def _check(
        self, handle: SaveHandle, writer: SafeStorageWriter
    ) -> tuple[BaseException, str] | None:
        """Wait for the commit (node-local) and check the checkpoint; why it is not trusted."""
        try:
            self._tiers.await_commit(handle.name, writer)
        except (DcpSafeError, OSError) as exc:
            return exc, f"remote commit failed: {exc}"
        try:
            self._tiers.verify(handle.name, deep=self._deep)
        except (DcpSafeError, OSError) as exc:
            return exc, f"verification failed: {exc}"
        return None

    def _replicate(self, handle: SaveHandle, writer: SafeStorageWriter) -> None:
        if writer.topology.replica is None:  # a node-local save is uploaded before it counts
            handle.replicated.set_result(None)
            return
        remote = writer.replication(handle.name)
        self._tiers.track_replication(handle.name, handle.replicated)
        remote.add_done_callback(lambda done: self._replicated(handle, done))

    def _replicated(self, handle: SaveHandle, done: Future[Any]) -> None:
        if handle.replicated.done():
            return
        error = done.exception()
        if error is None:
            self._ledger.record("committed", handle, tier="remote")
            with contextlib.suppress(InvalidStateError):
                handle.replicated.set_result(done.result())
        elif isinstance(error, ReplicationSkippedError):  # policy, not a failure
            self._ledger.record("skipped", handle, tier="remote", reason=str(error))
            handle.replicated.set_exception(error)
        else:
            self._ledger.fail(handle, error, tier="remote", future=handle.replicated)
        self._tiers.replication_done(handle.name, handle.replicated)
