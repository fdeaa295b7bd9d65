"""What happened to each save: counters, history events, and kept errors.

One way of writing down every outcome (skip, superseded, failure, commit). Recording never
fails the outcome it records: a failure's futures are set first, and a failed history append or
telemetry call is logged and counted (``bookkeeping_failures``), never raised.

Thread safety: any thread; the state is guarded by the manager's condition.

The coordinator's history appends run off the decision path, in order, on their own thread
(:meth:`Ledger.append`; why, and what a failed append does: docs/multirank.md, "Bookkeeping never
decides"). Each save has one telemetry span from admission to verified commit
(:meth:`Ledger.opened`): the stager's and the wrapped writer's spans opened on the same thread nest
under it; with ``executor="process"`` the worker's are adopted under it. With no telemetry every
call there is a no-op and writers are not wrapped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import fields
from typing import Any

from dcp_safe.checkpoints.history import History
from dcp_safe.manager.cadence import Choice
from dcp_safe.manager.handles import ManagerStats, SaveHandle, settle
from dcp_safe.telemetry.recorder import Telemetry

log = logging.getLogger("dcp_safe.manager")

_EVENTS_KEPT = 10_000  # per rank, in memory: the newest ones
READ_FLUSH_S = 30.0  # how long a read waits for queued appends before it reads what is there

# The counters of ManagerStats that its parts keep rather than the ledger.
_NOT_COUNTED = {"pruned", "waited_s", "waiting", "fallback_reason"} | set(vars(Choice()))


class Ledger:
    """The manager's record of outcomes: the commit root's ``history`` is appended to by the
    coordinator only; every rank keeps its events in memory (:meth:`events`)."""

    def __init__(self, history: History, telemetry: Telemetry | None, *, coordinator: bool) -> None:
        self.cond = threading.Condition()  # the manager's: every part's state is guarded by it
        self.history, self._appends = history, coordinator  # only the coordinator appends
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-history")
        self.telemetry = telemetry
        self._events: deque[dict[str, Any]] = deque(maxlen=_EVENTS_KEPT)
        self._counts = {f.name: 0 for f in fields(ManagerStats) if f.name not in _NOT_COUNTED}
        self._errors: list[BaseException] = []
        self._raised = 0
        self._handles: weakref.WeakSet[SaveHandle] = weakref.WeakSet()

    def count(self, key: str) -> None:
        with self.cond:
            self._counts[key] += 1

    def counts(self) -> dict[str, Any]:  # ints, spread into ManagerStats beside its str fields
        with self.cond:
            return dict(self._counts)

    def track(self, handle: SaveHandle) -> None:  # weakly, for abandon()
        with self.cond:
            self._handles.add(handle)

    def abandon(self, error: BaseException) -> None:
        """Fail every tracked handle's pending futures with ``error``: a ``close`` that gave up
        on work in flight leaves it running in the background, but no caller waits for ever."""
        with self.cond:
            handles = list(self._handles)
        reason = f"given up by close: {error}"
        for handle in handles:
            tiers = {"local": handle.committed, "remote": handle.replicated}
            pending = {tier: f for tier, f in tiers.items() if not f.done()}
            settle([handle.staged, *pending.values()], error)  # unless done meanwhile
            # Recorded so that a rank that gave up has the events a peer that saw the outcome has.
            if pending:  # the first tier pending: local before remote
                self.record("failed", handle, tier=next(iter(pending)), reason=reason)

    def record(
        self, event: str, handle: SaveHandle | tuple[int | None, str | None], **extra: Any
    ) -> None:
        step, name = (handle.step, handle.name) if isinstance(handle, SaveHandle) else handle
        line = {"event": event, "step": step, "name": name}
        line |= {k: v for k, v in extra.items() if v is not None}
        with self.cond:
            self._events.append(line)
        self.append(event, step, name, **extra)

    def quietly(self, what: str, action: Callable[[], object]) -> None:  # logged, counted
        try:
            action()
        except Exception as exc:
            log.warning("dcp_safe: %s failed: %r", what, f"{type(exc).__name__}: {exc}"[:300])
            self.count("bookkeeping_failures")

    def events(self) -> list[dict[str, Any]]:
        with self.cond:
            return [dict(e) for e in self._events]

    def skip(self, handle: SaveHandle, reason: str, *, mark: str = "") -> None:
        self.count("skipped")
        log.info("checkpoint %s skipped: %s", handle.name, reason)
        self.record("skipped", handle, tier="local", reason=reason)
        self.quietly("telemetry", lambda: self.mark("skipped", handle, reason=mark or reason))

    def fail(
        self,
        handle: SaveHandle,
        error: BaseException,
        *,
        tier: str,
        reason: str | None = None,
        keep: bool = True,
        future: Future[Any] | None = None,
    ) -> None:
        """Fail the handle's futures (or just ``future``), then record the failure.

        ``keep`` holds the error for ``wait``/``close``; one raised to the caller is not kept.
        The futures come first: nothing that fails while recording can leave them pending.
        """
        with self.cond:
            self._counts["failed"] += 1
            if keep:
                self._errors.append(error)
        everything: list[Future[Any]] = [handle.staged, handle.committed, handle.replicated]
        settle(everything if future is None else [future], error)
        log.warning("checkpoint %s failed (%s): %s", handle.name, tier, error)
        if tier == "local":
            self.quietly("telemetry", lambda: self.end_span(handle, error))
        self.record(
            "failed", handle, tier=tier, reason=reason or f"{type(error).__name__}: {error}"
        )

    def keep(self, error: BaseException) -> None:  # for wait() or close() to raise
        with self.cond:
            self._errors.append(error)

    def unraised(self) -> list[BaseException]:  # oldest first; from now on counted as raised
        with self.cond:
            errors = self._errors[self._raised :]
            self._raised = len(self._errors)
            return errors

    def append(self, event: str, step: int | None, name: str | None, **fields: Any) -> None:
        """Queue one event (as :meth:`History.append` takes it); never raises for storage."""
        if not self._appends:
            return
        try:
            self._pool.submit(self._write, event, step, name, fields)
        except RuntimeError:  # closed (interpreter exit): write it here, or give up quietly
            self._write(event, step, name, fields)

    def flush(self, timeout_s: float | None) -> None:  # for the events queued so far
        try:
            self._pool.submit(lambda: None).result(timeout=timeout_s)
        except FutureTimeout:
            log.warning("history appends still pending after %s s", timeout_s)
        except RuntimeError:  # closed: nothing more is queued
            pass

    def close_history(self, timeout_s: float | None) -> None:
        self.flush(timeout_s)
        self._pool.shutdown(wait=False)

    def _write(self, event: str, step: int | None, name: str | None, fields: Any) -> None:
        what = f"recording the {event!r} event of {name!r} in the history"
        self.quietly(what, lambda: self.history.append(event, step, name, **fields))

    def opened(self, handle: SaveHandle) -> contextlib.AbstractContextManager[object]:
        """Open the save's root span (ended by :meth:`end_span`); phases inside nest under it."""
        if self.telemetry is None:
            return contextlib.nullcontext()
        return self.telemetry.within(self.telemetry.begin_save(handle.name, handle.step))

    def end_span(self, handle: SaveHandle, error: BaseException | None) -> None:
        span = None if self.telemetry is None else self.telemetry.root(handle.name)
        if span is not None:
            span.end() if error is None else span.fail(error)

    def adopt(self, name: str, events: list[Any], replication: Future[Any] | None) -> None:
        """A worker's spans of save ``name`` under its root, and a ``replication`` span until the
        worker's ``replication`` resolves (as the telemetry wrapper records it with threads)."""
        if self.telemetry is None:
            return
        self.telemetry.adopt(events, self.telemetry.root(name))
        if replication is not None:
            self.telemetry.follow_replication(name, replication)

    def wrap(self, writer: Any) -> Any:
        return writer if self.telemetry is None else self.telemetry.wrap_writer(writer)

    def mark(self, name: str, handle: SaveHandle, **attrs: Any) -> None:
        if self.telemetry is not None:
            self.telemetry.mark(name, save=handle.name, step=handle.step, **attrs)
