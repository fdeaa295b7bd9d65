"""Telemetry spans of the manager's saves: one root ``save`` span, admission to verified commit.

The stager's and the wrapped writer's spans opened on the same thread nest under it; with
``executor="process"`` the worker's are adopted under it (:meth:`SaveSpans.adopt`). With no
telemetry every call here is a no-op and writers are not wrapped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from dcp_safe.manager.handles import SaveHandle
from dcp_safe.observe import Phase, SpanHandle
from dcp_safe.telemetry.instrument import end_replication
from dcp_safe.telemetry.recorder import Telemetry

__all__ = ["SaveSpans"]


class SaveSpans:
    """The open root span of each save, by checkpoint name (``telemetry=None``: none)."""

    def __init__(self, telemetry: Telemetry | None) -> None:
        self.telemetry = telemetry
        self._lock = threading.Lock()
        self._open: dict[str, SpanHandle] = {}

    @contextlib.contextmanager
    def opened(self, handle: SaveHandle) -> Iterator[None]:
        """Open the save's root span; phases started on this thread inside nest under it."""
        if self.telemetry is None:
            yield
            return
        span = self.telemetry.begin_save(handle.name, handle.step)
        with self._lock:
            self._open[handle.name] = span
        with self.telemetry.within(span):
            yield

    def end(self, handle: SaveHandle, error: BaseException | None) -> None:
        """Close the save's root span (once; later calls do nothing)."""
        with self._lock:
            span = self._open.pop(handle.name, None)
        if span is None:
            return
        if error is None:
            span.end()
        else:
            span.fail(error)

    def adopt(self, name: str, events: list[Any], replication: Future[Any] | None) -> None:
        """Record the spans a worker process recorded for save ``name`` under its root, and
        a ``replication`` span from now until the worker's ``replication`` resolves (as the
        telemetry wrapper records it with threads)."""
        if self.telemetry is None:
            return
        with self._lock:
            span = self._open.get(name)
        self.telemetry.adopt(events, span)
        if replication is not None:
            replicating = self.telemetry.begin(Phase.REPLICATION, save=name)
            replication.add_done_callback(lambda done: end_replication(replicating, done))

    def wrap(self, writer: Any) -> Any:
        """``writer`` behind the telemetry wrapper, or as it is without telemetry."""
        return writer if self.telemetry is None else self.telemetry.wrap_writer(writer)

    def mark(self, name: str, handle: SaveHandle, **attrs: Any) -> None:
        """A point event about ``handle`` (``skipped``, ``fallback``)."""
        if self.telemetry is not None:
            self.telemetry.mark(name, save=handle.name, step=handle.step, **attrs)
