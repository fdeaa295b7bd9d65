"""The switch between asynchronous and synchronous saving: feeds :mod:`~dcp_safe.manager.fallback`.

The ``fallback`` history event is recorded when the *agreed* decision first says so, not when
this rank's monitor trips: latencies trip each rank at its own moment, and the record must be
the same on every rank.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dcp_safe.manager.fallback import FallbackMonitor
from dcp_safe.manager.handles import SaveHandle
from dcp_safe.manager.ledger import Ledger
from dcp_safe.manager.spans import SaveSpans

__all__ = ["FallbackSwitch"]

log = logging.getLogger("dcp_safe.manager")


@dataclass(kw_only=True, eq=False)
class FallbackSwitch:
    """Feeds a :class:`FallbackMonitor` and acts on its verdicts.

    Args:
        sample_memory: the host's available bytes now (``None`` when unknown).
        cond: the manager's condition (the monitor is not thread-safe by itself).
    """

    monitor: FallbackMonitor
    sample_memory: Callable[[], int | None]
    clock: Callable[[], float]
    ledger: Ledger
    spans: SaveSpans
    cond: threading.Condition
    _announced: bool = field(default=False, init=False)  # the agreed fallback is in the record

    @property
    def reason(self) -> str | None:
        """Why saves are synchronous now (``None``: they are not)."""
        with self.cond:
            return self.monitor.reason

    def on_request(self, handle: SaveHandle, leaked_bytes: Callable[[], int]) -> str | None:
        """Feed a save request; the reason this rank saves synchronously (``None``: it does not).

        Args:
            leaked_bytes: staging bytes still in use although no save is in flight (called only
                when no other trigger fired).
        """
        now = self.clock()
        available = self.sample_memory()
        self.ledger.requested(handle.name, now)
        with self.cond:
            reason = self.monitor.on_request(now, available)
        in_use = leaked_bytes() if reason is None else 0
        with self.cond:
            reason = reason or self.monitor.on_idle(in_use)
            current = self.monitor.reason
        if reason is not None:
            self._switched(handle, reason)
        return current

    def follow(self, handle: SaveHandle, agreed: str | None) -> None:
        """Act on the agreed decision of a request: switch too when the ranks fall back
        because of a peer, and record the fallback once, at the same request on every rank."""
        with self.cond:
            if agreed is None:
                self._announced = False
                return
            reason = (
                None if self.monitor.tripped else self.monitor.trip(f"peers fell back: {agreed}")
            )
            first, self._announced = not self._announced, True
        if reason is not None:
            self._switched(handle, reason)
        if first:
            self.ledger.record("fallback", handle, reason=agreed)

    def on_committed(self, handle: SaveHandle, *, counted: bool = True) -> None:
        """Feed the completion latency of a committed save, unless not ``counted``: one that
        ran on a thread while the checkpoint worker started shares the host with its imports
        and carries the first save's one-time costs; the steady state is what is judged."""
        requested_at = self.ledger.completed(handle.name)
        if requested_at is None or not counted:
            return
        with self.cond:
            reason = self.monitor.on_completed(self.clock() - requested_at)
        if reason is not None:
            self._switched(handle, reason)

    def rearm(self) -> None:
        """Back to asynchronous saves (no-op when not switched)."""
        with self.cond:
            was = self.monitor.reason
            self.monitor.rearm()
        if was is not None:
            log.info("dcp_safe: asynchronous checkpoints re-armed (fell back: %s)", was)
            self.ledger.record("rearmed", (None, None), reason=f"was: {was}")

    def _switched(self, handle: SaveHandle, reason: str) -> None:
        log.warning("dcp_safe: falling back to synchronous checkpoints: %s", reason)
        self.spans.mark("fallback", handle, reason=reason)
