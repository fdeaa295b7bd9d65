"""Telemetry events and where they go: the :class:`Event` record (one JSON line each, schema
:data:`SCHEMA_VERSION`), the sink interface, an in-memory sink and a JSON-lines file sink.

The vocabulary the instrumented components use (phases, spans, the recorder protocol and the
null recorder) lives one layer down, in :mod:`dcp_safe.observe`, so those components never
import telemetry. A sink receives every :class:`Event` and, if it wants them, every
:class:`~dcp_safe.telemetry.memory.MemorySample`. Sinks are called on the thread that produced
the event (training, staging, upload, replicator, sampler threads), so each one locks its own
state; none blocks for long. The Prometheus sink lives in :mod:`dcp_safe.telemetry.prometheus`
because its dependency is optional.
"""

from __future__ import annotations

import enum
import json
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcp_safe.telemetry.memory import MemorySample

SCHEMA_VERSION = 1


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
        name: the phase (spans), the mark's name, or ``"step"``.
        t: seconds since the epoch (a monotonic clock anchored to wall time once).
        span: the span's id, unique within one :class:`~dcp_safe.telemetry.Telemetry`.
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
        fields = {"kind": self.kind.value, "attrs": dict(self.attrs), "schema": SCHEMA_VERSION}
        return {**asdict(self), **fields}


class Sink:
    """Base of every sink: override what you need; the defaults ignore the call."""

    def emit(self, event: Event) -> None:
        """One event, on the thread that produced it."""

    def sample(self, sample: MemorySample) -> None:
        """One memory sample, on the sampler's thread."""

    def close(self) -> None:
        """Flush and release what the sink holds."""


class MemorySink(Sink):
    """Keeps the newest ``max_events`` events in memory (tests, the report)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, kind: EventKind | None = None) -> list[Event]:
        """A copy of the events kept, oldest first (only ``kind`` when given)."""
        with self._lock:
            return [e for e in self._events if kind is None or e.kind is kind]


class JsonLinesSink(Sink):
    """Appends one JSON object per line to ``path`` (schema in ``docs/telemetry.md``).

    Args:
        include_samples: also write memory samples (``kind: "sample"``); off by default
            because the sampler runs every few tens of milliseconds during saves.
    """

    def __init__(self, path: str | os.PathLike[str], *, include_samples: bool = False) -> None:
        self.path = os.fspath(path)
        self.include_samples = include_samples
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        self._write(event.to_dict())

    def sample(self, sample: MemorySample) -> None:
        if self.include_samples:
            self._write({"schema": SCHEMA_VERSION, "kind": "sample", **sample.to_dict()})

    def _write(self, record: dict[str, object]) -> None:
        line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return  # closed: late events from background threads are dropped
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
