"""Checkpoint telemetry: memory sampling, phase spans, JSON lines, Prometheus, a save report.

Off by default: components hold :data:`~dcp_safe.observe.NULL_RECORDER` until given a
:class:`Telemetry`. See ``docs/telemetry.md``.
"""

from dcp_safe.observe import NULL_RECORDER, Phase
from dcp_safe.telemetry.memory import MemorySample, MemorySampler
from dcp_safe.telemetry.recorder import InstrumentedWriter, Telemetry
from dcp_safe.telemetry.report import SaveSummary, TelemetryReport, build_report
from dcp_safe.telemetry.sinks import (
    SCHEMA_VERSION,
    Event,
    EventKind,
    JsonLinesSink,
    MemorySink,
    PrometheusSink,
    Sink,
)

__all__ = [
    "NULL_RECORDER",
    "SCHEMA_VERSION",
    "Event",
    "EventKind",
    "InstrumentedWriter",
    "JsonLinesSink",
    "MemorySample",
    "MemorySampler",
    "MemorySink",
    "Phase",
    "PrometheusSink",
    "SaveSummary",
    "Sink",
    "Telemetry",
    "TelemetryReport",
    "build_report",
]
