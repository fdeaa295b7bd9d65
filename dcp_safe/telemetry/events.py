"""Telemetry events: the :class:`Event` record, one JSON line each (schema :data:`SCHEMA_VERSION`).

The vocabulary the instrumented components use (phases, spans, the recorder protocol
and the null recorder) lives one layer down, in :mod:`dcp_safe.observe`, so those components
never import telemetry.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SCHEMA_VERSION", "Event", "EventKind"]

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
        out = asdict(self)
        out["kind"] = self.kind.value
        out["attrs"] = dict(self.attrs)
        out["schema"] = SCHEMA_VERSION
        return out
