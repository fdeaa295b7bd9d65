"""Helpers for span assertions: pair starts with ends, check order and nesting."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_safe.telemetry import Event, EventKind


@dataclass(frozen=True)
class Interval:
    phase: str
    id: int
    parent: int | None
    save: str | None
    start: float
    end: float
    ok: bool
    bytes: int | None


def intervals(events: list[Event]) -> list[Interval]:
    """Every span as an interval; fails if a span was started twice, ended twice or not ended."""
    starts = {e.span: e for e in events if e.kind is EventKind.SPAN_START}
    ends = [e for e in events if e.kind is EventKind.SPAN_END]
    assert len(starts) == len([e for e in events if e.kind is EventKind.SPAN_START])
    assert sorted(e.span for e in ends) == sorted(starts), "a span was not ended exactly once"
    out = []
    for end in ends:
        start = starts[end.span]
        assert end.parent == start.parent and end.save == start.save
        assert end.t >= start.t
        assert end.ok is not None and end.duration_s is not None
        out.append(
            Interval(end.name, end.span or 0, end.parent, end.save, start.t, end.t, end.ok,
                     end.bytes)
        )  # fmt: skip
    return out


def check_nesting(spans: list[Interval]) -> None:
    """Every child lies within its parent's interval and belongs to the same save."""
    by_id = {s.id: s for s in spans}
    for span in spans:
        if span.parent is None:
            continue
        parent = by_id[span.parent]
        assert parent.start <= span.start and span.end <= parent.end, (span, parent)
        assert span.save == parent.save


def only(spans: list[Interval], phase: str, save: str | None = None) -> Interval:
    found = [s for s in spans if s.phase == phase and (save is None or s.save == save)]
    assert len(found) == 1, (phase, save, found)
    return found[0]


def phases(spans: list[Interval], save: str) -> list[str]:
    """The phases of ``save`` in start order."""
    return [s.phase for s in sorted(spans, key=lambda s: (s.start, s.id)) if s.save == save]
