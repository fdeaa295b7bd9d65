"""A save's metrics in its manifest and history: optional, strictly decoded, and a manifest
without them is byte for byte what older versions wrote."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.history import History
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.schema import FileRecord, Manifest

_OLD = Manifest(
    name="step_1",
    save_id="abc",
    world_size=1,
    created_at=1.5,
    checksum_algorithm="xxh3_128",
    compression="none",
    files=(FileRecord(path="__0_0.distcp", size=10),),
    items=(),
    dcp_safe_version="0.1.0",
    torch_version="2.13.0",
    step=1,
)


def test_a_manifest_without_metrics_decodes_and_writes_as_before() -> None:
    raw = _OLD.to_json()
    assert b"metrics" not in raw
    decoded = Manifest.from_json(raw, "manifest.json")
    assert decoded.metrics is None and decoded.to_json() == raw


def test_metrics_round_trip_as_floats_and_labels() -> None:
    manifest = dataclasses.replace(_OLD, metrics={"val_loss": 1, "config": "sha256:ab"})
    assert manifest.metrics == {"val_loss": 1.0, "config": "sha256:ab"}
    assert Manifest.from_json(manifest.to_json(), "m").metrics == manifest.metrics


@pytest.mark.parametrize(
    "metrics",
    [
        [1.0],
        {"a": True},
        {"a": {"nested": 1.0}},
        {"a": [1.0]},
        {"a": None},
        {"a": "\x1b[31m"},
        {"\x00": 1.0},
        {"a": 1e400},
        {f"m{i}": 1.0 for i in range(65)},
    ],
)
def test_malformed_metrics_make_the_manifest_corrupt(metrics: object) -> None:
    raw = json.loads(_OLD.to_json())
    raw["metrics"] = metrics
    with pytest.raises(CheckpointCorruptError, match=r"malformed manifest|not valid JSON"):
        Manifest.from_json(json.dumps(raw).encode(), "manifest.json")


def test_a_history_line_with_malformed_metrics_is_skipped(tmp_path: Path) -> None:
    history = History(open_backend(str(tmp_path)))
    history.append("committed", 1, "step_1", metrics={"val_loss": 0.5})
    line = {"event": "committed", "step": 2, "name": "step_2", "time": 1.0, "metrics": [1]}
    with (tmp_path / "_history.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    assert [e.get("metrics") for e in history.read()] == [{"val_loss": 0.5}]
