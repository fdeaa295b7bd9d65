"""What the core reports to telemetry: phases, spans, the recorder protocol, the null recorder.

This module is the seam between the layers that do the work (staging, the writers, the manager)
and :mod:`dcp_safe.telemetry`, which records it. Both sides import it; neither imports the
other. Components hold a ``telemetry`` attribute that defaults to :data:`NULL_RECORDER`, whose
calls return at once and allocate nothing, so telemetry off costs a method call per *phase*
(never per tensor or per byte) and starts no thread. Spans are explicit ``begin``/``end``
handles because a save's phases cross threads: staging starts on the training thread and ends
on the staging thread; replication ends on the replicator's.
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypedDict, Unpack


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

    ``begin`` keeps them spelled out: keyword parameters cost the null recorder no dict.
    """

    save: str | None
    step: int | None
    parent: SpanHandle | None
    bytes: int | None


class NullSpan:
    __slots__ = ()
    # Class attributes: with no slots, an instance cannot set them.
    id: int | None = None
    save: str | None = None
    step: int | None = None

    def end(self, *, bytes: int | None = None, **attrs: Any) -> None: ...

    def fail(self, error: BaseException | str) -> None: ...


_NULL_SPAN = NullSpan()
_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()
_NULL_SPAN_CONTEXT: AbstractContextManager[SpanHandle] = nullcontext(_NULL_SPAN)


class Recorder(Protocol):
    """What instrumented components call. Every method may be called from any thread.

    The bodies here are telemetry off, which :class:`NullRecorder` inherits: each call returns
    at once and allocates nothing.
    """

    enabled: bool

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
        return _NULL_SPAN

    def span(self, phase: Phase, **options: Unpack[SpanOptions]) -> Any:
        """A context manager: a span on this thread, a profiler range, ended with the outcome."""
        return _NULL_SPAN_CONTEXT

    def mark(
        self, name: str, *, save: str | None = None, step: int | None = None, **attrs: Any
    ) -> None:
        """A point event (``skipped``, ``fallback``, ``retry``)."""
        return None

    def profile(self, phase: Phase) -> AbstractContextManager[Any]:
        """A ``torch.profiler.record_function`` range on this thread (nothing when off)."""
        return _NULL_CONTEXT


class NullRecorder(Recorder):
    enabled = False  # telemetry off: the protocol's bodies, which return at once


NULL_RECORDER = NullRecorder()


class Instrumentable(Protocol):
    """A component telemetry can attach to (the stager): it reports through ``telemetry``, and
    its ``stats()`` carries ``pinned_bytes`` for the memory sampler."""

    telemetry: Recorder

    def stats(self) -> Any: ...


class StagerObserver(Protocol):
    """What a stager's ``telemetry=`` argument must do: take the stager in (it then sets the
    stager's ``telemetry`` recorder). :class:`dcp_safe.telemetry.Telemetry` is one."""

    def attach_stager(self, stager: Instrumentable) -> object: ...
