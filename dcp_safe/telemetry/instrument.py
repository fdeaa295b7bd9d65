"""Instrumentation by wrapping: a delegating ``StorageWriter`` and a counting retry policy.

:class:`InstrumentedWriter` forwards every DCP call to the wrapped writer and times it::

    reset(name)            opens the save's root span if none is open (plain ``dcp.save``),
                           then the ``plan`` span (DCP's planning, until write_data)
    write_data             the ``write`` span: this rank's items serialized, checksummed and
                           streamed to storage. The writer streams, so serialization and I/O are
                           one pass, not two intervals; ``bytes`` is what this rank wrote
    finish                 the ``commit`` span (coordinator: verify and publish)
    after finish           the ``replication`` span, from the writer's replication future to its
                           outcome (a sibling of the root: it outlives the save)

A wrapper, not hooks, so the writer stays free of telemetry and telemetry off wraps nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future as Future_
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_safe.observe import Phase, SpanHandle
from dcp_safe.topology import Topology

if TYPE_CHECKING:
    from dcp_safe.telemetry.recorder import Telemetry

__all__ = ["InstrumentedWriter", "end_replication"]


class InstrumentedWriter(StorageWriter):
    """``writer`` with plan/write/commit/replication spans recorded to ``telemetry``."""

    def __init__(self, writer: Any, telemetry: Telemetry) -> None:
        super().__init__()
        self.inner = writer
        self.telemetry = telemetry
        self._name: str | None = None
        # Only when this wrapper opened it; None: the recorder finds the root by name.
        self._root: SpanHandle | None = None
        self._plan: SpanHandle | None = None
        self._coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # Still open: another rank failed, so DCP never called finish() here; close them.
        self._fail_open("a new save started before this one finished")
        self._name = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._guard(self.inner.reset, checkpoint_id)
        if self._name is None:
            return
        tel = self.telemetry
        if tel.root(self._name) is None:
            self._root = tel.begin_save(self._name, getattr(self.inner, "step", None))
        self._plan = tel.begin(Phase.PLAN, save=self._name, parent=self._root)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        self._guard(self.inner.set_up_storage_writer, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return cast(SavePlan, self._guard(self.inner.prepare_local_plan, plan))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return cast(list[SavePlan], self._guard(self.inner.prepare_global_plan, plans))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        opened, self._plan = self._plan, None
        if opened is not None:
            opened.end()
        with self._phase(Phase.WRITE) as span:
            future: Future[list[WriteResult]] = self.inner.write_data(plan, planner)
            results = future.wait()
            span.end(bytes=sum(r.size_in_bytes for r in results), items=len(results))
        if not self._coordinator:
            self._close_root()  # finish() runs on the coordinator only
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        nbytes = sum(r.size_in_bytes for rank in results for r in rank)
        with self._phase(Phase.COMMIT) as span:
            self.inner.finish(metadata, results)
            span.end(bytes=nbytes)
        self._close_root()
        self._watch_replication()

    def storage_meta(self) -> StorageMeta | None:
        meta: StorageMeta | None = self.inner.storage_meta()
        return meta

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # DCP asks this only of writer classes it might pick by itself, never of an instance
        # passed as storage_writer=; a wrapper is never picked, so it claims nothing.
        return False

    def __getattr__(self, name: str) -> Any:
        # Everything else (checkpoint_id, root, replication, ...) is the inner writer's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- helpers --------------------------------------------------------------------------------

    @contextmanager
    def _phase(self, phase: Phase) -> Iterator[SpanHandle]:
        """A span of ``phase`` over the block; an exception fails it and the root (re-raised)."""
        try:
            with self.telemetry.span(phase, save=self._name, parent=self._root) as span:
                yield span
        except BaseException as exc:
            self._close_root(exc)
            raise

    def _guard(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except BaseException as exc:
            self._fail_open(exc)
            raise

    def _close_root(self, error: BaseException | str | None = None) -> None:
        root, self._root = self._root, None
        if root is None:
            return
        if error is None:
            root.end()
        else:
            root.fail(error)

    def _fail_open(self, error: BaseException | str) -> None:
        opened, self._plan = self._plan, None
        if opened is not None:
            opened.fail(error)
        self._close_root(error)

    def _watch_replication(self) -> None:
        name = self._name
        topology: Topology | None = getattr(self.inner, "topology", None)
        if name is None or topology is None or topology.uploads_to is None:
            return
        replication: Callable[[str], Future_[Any]] = self.inner.replication
        future = replication(name)
        span = self.telemetry.begin(Phase.REPLICATION, save=name)
        future.add_done_callback(lambda done: end_replication(span, done))


def end_replication(span: SpanHandle, done: Future_[Any]) -> None:
    """End a ``replication`` span with the outcome of its future (bytes: its manifest's)."""
    if done.cancelled():
        span.fail("cancelled")
        return
    error = done.exception()
    if error is not None:
        span.fail(error)
        return
    manifest = done.result()
    span.end(bytes=getattr(manifest, "total_bytes", None))
