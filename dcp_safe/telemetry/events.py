"""Telemetry events and the recorder interface every instrumented component talks to.

This module owns the vocabulary: the phases of a save, the :class:`Event` record (one JSON line
each, schema :data:`SCHEMA_VERSION`), the :class:`Recorder` protocol, and the null recorder used
when telemetry is off.

Why a recorder handed in rather than a global: components hold ``recorder`` as an attribute that
defaults to :data:`NULL_RECORDER`, whose calls return at once and allocate nothing, so telemetry
off costs a method call per *phase* (never per tensor or per byte) and starts no thread. Spans
are explicit ``begin``/``end`` handles because a save's phases cross threads: staging starts on
the training thread and ends on the staging thread; replication ends on the replicator's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypedDict, Unpack

__all__ = [
    "NULL_RECORDER",
    "SCHEMA_VERSION",
    "Event",
    "EventKind",
    "NullRecorder",
    "NullSpan",
    "Phase",
    "Recorder",
    "SpanHandle",
    "SpanOptions",
]

SCHEMA_VERSION = 1


class Phase(str, enum.Enum):
    """The phases of one save, in the order they start.

    ``SAVE`` is the root span (request to local commit); ``RELEASE`` and ``REPLICATION`` are its
    siblings, because they may end after it.
    """

    SAVE = "save"
    STATE_DICT = "state_dict"
    STAGING = "staging"
    PLAN = "plan"
    WRITE = "write"
    COMMIT = "commit"
    RELEASE = "release"
    REPLICATION = "replication"


class EventKind(str, enum.Enum):
    """What one :class:`Event` line records."""

    SPAN_START = "span_start"
    SPAN_END = "span_end"
    MARK = "mark"  # a point event: skipped, fallback, retry
    STEP = "step"  # one training step reported by the loop


@dataclass(frozen=True, kw_only=True)
class Event:
    """One telemetry event; :meth:`to_dict` is exactly one JSON line of schema version 1.

    Attributes:
        kind: see :class:`EventKind`.
        name: the phase (spans), the mark's name, or ``"step"``.
        t: seconds since the epoch (a monotonic clock anchored to wall time once).
        rank: the process's rank (0 without a process group).
        span: the span's id, unique within one :class:`~dcp_safe.telemetry.Telemetry`.
        parent: the enclosing span's id.
        save: the checkpoint name.
        step: the training step.
        bytes: bytes the phase moved.
        duration_s: ``span_end`` and ``step`` only.
        ok: ``span_end`` only: the phase succeeded.
        error: ``span_end`` only: ``"Type: message"`` of the failure.
        attrs: anything else, JSON-compatible.
    """

    kind: EventKind
    name: str
    t: float
    rank: int = 0
    span: int | None = None
    parent: int | None = None
    save: str | None = None
    step: int | None = None
    bytes: int | None = None
    duration_s: float | None = None
    ok: bool | None = None
    error: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-lines form: every field, plus ``schema``."""
        out = asdict(self)
        out["kind"] = self.kind.value
        out["attrs"] = dict(self.attrs)
        out["schema"] = SCHEMA_VERSION
        return out


class SpanHandle(Protocol):
    """An open span; ``end`` or ``fail`` closes it (later calls are ignored)."""

    @property
    def id(self) -> int | None: ...

    @property
    def save(self) -> str | None: ...

    @property
    def step(self) -> int | None: ...

    def end(self, *, bytes: int | None = None, **attrs: Any) -> None: ...

    def fail(self, error: BaseException | str) -> None: ...


class SpanOptions(TypedDict, total=False):
    """The keywords of :meth:`Recorder.begin`, which :meth:`Recorder.span` passes on unchanged.

    Named once for every ``span`` (the protocol, :class:`NullRecorder`,
    :class:`~dcp_safe.telemetry.Telemetry`). ``begin`` keeps them spelled out: it is what the
    instrumented components call, and keyword parameters cost the null recorder no dict.
    """

    save: str | None
    step: int | None
    parent: SpanHandle | None
    bytes: int | None


class Recorder(Protocol):
    """What instrumented components call. Every method may be called from any thread."""

    @property
    def enabled(self) -> bool: ...

    def begin(
        self,
        phase: Phase,
        *,
        save: str | None = None,
        step: int | None = None,
        parent: SpanHandle | None = None,
        bytes: int | None = None,
    ) -> SpanHandle:
        """Open a span; without ``parent``: this thread's current span, else the save's root."""
        ...

    def span(self, phase: Phase, **options: Unpack[SpanOptions]) -> Any:
        """A context manager: a span on this thread, a profiler range, ended with the outcome.

        ``options`` are :meth:`begin`'s keywords (see :class:`SpanOptions`).
        """
        ...

    def mark(
        self, name: str, *, save: str | None = None, step: int | None = None, **attrs: Any
    ) -> None:
        """A point event (``skipped``, ``fallback``, ``retry``)."""
        ...

    def profile(self, phase: Phase) -> AbstractContextManager[Any]:
        """A ``torch.profiler.record_function`` range on this thread (nothing when off)."""
        ...


class NullSpan:
    """The span of :class:`NullRecorder`: does nothing."""

    __slots__ = ()

    @property
    def id(self) -> int | None:
        return None

    @property
    def save(self) -> str | None:
        return None

    @property
    def step(self) -> int | None:
        return None

    def end(self, *, bytes: int | None = None, **attrs: Any) -> None:
        return None

    def fail(self, error: BaseException | str) -> None:
        return None


_NULL_SPAN = NullSpan()
_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()
_NULL_SPAN_CONTEXT: AbstractContextManager[SpanHandle] = nullcontext(_NULL_SPAN)


class NullRecorder:
    """Telemetry off: every call returns at once; no thread, no allocation per call."""

    enabled = False

    def begin(
        self,
        phase: Phase,
        *,
        save: str | None = None,
        step: int | None = None,
        parent: SpanHandle | None = None,
        bytes: int | None = None,
    ) -> SpanHandle:
        return _NULL_SPAN

    def span(
        self, phase: Phase, **options: Unpack[SpanOptions]
    ) -> AbstractContextManager[SpanHandle]:
        return _NULL_SPAN_CONTEXT

    def mark(
        self, name: str, *, save: str | None = None, step: int | None = None, **attrs: Any
    ) -> None:
        return None

    def profile(self, phase: Phase) -> AbstractContextManager[Any]:
        return _NULL_CONTEXT


NULL_RECORDER = NullRecorder()
