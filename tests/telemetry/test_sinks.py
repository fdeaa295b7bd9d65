"""Sinks: the JSON-lines schema (golden file), Prometheus text that parses, the report."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support import make_state

from dcp_safe import Runtime
from dcp_safe.errors import ConfigError
from dcp_safe.manager import CheckpointManager
from dcp_safe.telemetry import JsonLinesSink, Phase, PrometheusSink, Telemetry

GOLDEN = Path(__file__).parent / "golden" / "events_v1.jsonl"
DEADLINE_S = 120


def _scripted(path: Path) -> Telemetry:
    """A telemetry on a fake clock (one tick per reading) that records a fixed script."""
    ticks = itertools.count()
    tel = Telemetry(sinks=[JsonLinesSink(path)], sample_memory=False, rank=0,
                    clock=lambda: 1_800_000_000.0 + next(ticks) / 4)  # fmt: skip
    tel.step(0)
    root = tel.begin_save("step_000000010", 10)
    with tel.within(root):
        staging = tel.begin(Phase.STAGING, bytes=4096)
    staging.end(allocated_bytes=0)
    with tel.span(Phase.WRITE, save="step_000000010") as write:
        write.end(bytes=5000, items=3)
    commit = tel.begin(Phase.COMMIT, save="step_000000010")
    commit.fail(OSError("disk full"))
    root.fail("OSError: disk full")
    tel.mark("skipped", save="step_000000011", step=11, reason="busy")
    tel.step(1)
    return tel


def test_json_lines_schema_matches_the_golden_file(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    _scripted(out).close()
    assert out.read_text() == GOLDEN.read_text()


def test_every_event_of_a_real_save_has_the_golden_keys(tmp_path: Path) -> None:
    keys = {frozenset(json.loads(line)) for line in GOLDEN.read_text().splitlines()}
    assert len(keys) == 1
    out = tmp_path / "events.jsonl"
    tel = Telemetry(sinks=[JsonLinesSink(out)], sample_memory=False)
    with tel, CheckpointManager(tmp_path / "root", runtime=Runtime(telemetry=tel)) as manager:
        handle = manager.save(1, make_state(0))
        assert handle is not None
        handle.committed.result(DEADLINE_S)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) >= 12
    assert {frozenset(line) for line in lines} == keys
    assert {line["schema"] for line in lines} == {1}


def test_prometheus_exposition_parses_and_counts_the_save(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with Telemetry(busy_interval_s=0.02) as tel:
        prom = PrometheusSink(tel)
        with CheckpointManager(
            tmp_path, when_busy="skip", runtime=Runtime(telemetry=tel)
        ) as manager:
            handle = manager.save(1, make_state(0))
            manager.save(2, make_state(0))  # skipped while the first is in flight, or saved
            assert handle is not None
            handle.committed.result(DEADLINE_S)
            manager.wait(DEADLINE_S)
            tel.mark("retry")
            text = prom.exposition()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    saved = samples[("dcp_safe_saves_total", (("outcome", "ok"),))]
    skipped = samples[("dcp_safe_skips_total", ())]
    assert saved + skipped == 2 and saved >= 1
    assert samples[("dcp_safe_retries_total", ())] == 1
    assert samples[("dcp_safe_saves_in_flight", ())] == 0
    assert families["dcp_safe_phase_duration_seconds"].type == "histogram"
    count = ("dcp_safe_phase_duration_seconds_count", (("outcome", "ok"), ("phase", "write")))
    assert samples[count] == saved
    assert samples[("dcp_safe_budget_envelope_bytes", ())] > 0
    assert samples[("dcp_safe_memory_rss_bytes", ())] > 0


def test_prometheus_sink_uses_its_own_registry() -> None:
    from prometheus_client import REGISTRY

    first, second = PrometheusSink(), PrometheusSink()  # no duplicate-name clash
    assert first.registry is not second.registry is not REGISTRY
    assert REGISTRY.get_sample_value("dcp_safe_saves_in_flight") is None


def test_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install dcp-safe\[telemetry\]"):
        PrometheusSink()


def test_report_aggregates_steps_completions_and_marks(tmp_path: Path) -> None:
    tel = _scripted(tmp_path / "events.jsonl")
    report: dict[str, Any] = tel.report().to_dict()
    tel.close()
    assert report["steps"] == 1 and report["step_p50_s"] == pytest.approx(2.5)
    assert report["skipped"] == 1 and report["completion_p50_s"] is None  # the one save failed
    (save,) = report["saves"]
    assert save["ok"] is False and save["error"] == "OSError: disk full"
    assert save["bytes"] == 5000 and save["phases_s"]["write"] == pytest.approx(0.25)
    assert save["stall_s"] == pytest.approx(0.5)  # request to the end of staging


def test_json_lines_sink_writes_memory_samples_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "samples.jsonl"
    with Telemetry(sinks=[JsonLinesSink(out, include_samples=True)]) as tel:
        assert tel.sampler is not None
        tel.sampler.sample_now()
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) >= 2  # the first at start, one here, one at stop
    assert {s["kind"] for s in samples} == {"sample"} and {s["schema"] for s in samples} == {1}
    assert all(s["rss_bytes"] > 0 and s["saves_in_flight"] == 0 for s in samples)
