"""History: the JSON-lines event file, appended locally and rewritten on object stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.history import HISTORY_FILE, History


def test_append_and_read_round_trip_on_a_local_root(tmp_path: Path) -> None:
    history = History(open_backend(str(tmp_path)))
    history.append("requested", 1, "step_1", tier="local")
    history.append("committed", 1, "step_1", tier="local", validated=True, reason=None)
    history.append("fallback", None, None, reason="p99")
    events = history.read()
    assert [e["event"] for e in events] == ["requested", "committed", "fallback"]
    assert "reason" not in events[1]  # None fields are left out
    assert events[2]["step"] is None and events[2]["reason"] == "p99"
    assert all(isinstance(e["time"], float) for e in events)
    lines = (tmp_path / HISTORY_FILE).read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["requested", "committed", "fallback"]
    assert history.validated_names() == {"step_1"}


def test_object_store_history_is_rewritten_whole(memory_root: str) -> None:
    history = History(open_backend(memory_root))
    assert history.read() == []
    for step in (1, 2, 3):
        history.append("committed", step, f"step_{step}", tier="local", validated=step != 2)
    assert [e["step"] for e in History(open_backend(memory_root)).read()] == [1, 2, 3]
    assert history.validated_names() == {"step_1", "step_3"}


def test_an_event_outside_the_schema_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown history event"):
        History(open_backend(str(tmp_path))).append("exploded", 1, "step_1")


@pytest.mark.parametrize(
    "tail",
    [b'{"event": "committed", "step": 3, "na', b"\x00" * 64, b"[1, 2]\n", b"\xff\xfe garbage\n"],
    ids=["torn", "nul-filled", "not-an-object", "not-utf8"],
)
def test_a_damaged_tail_is_skipped_and_the_next_event_starts_a_fresh_line(
    tmp_path: Path, tail: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Power loss mid-append leaves a torn or NUL-filled last line: the history still reads,
    a manager can start, and the next append is not glued onto the damage."""
    history = History(open_backend(str(tmp_path)))
    history.append("requested", 1, "step_1")
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(tail)

    assert [e["name"] for e in history.read()] == ["step_1"]
    assert "skipped" in caplog.text

    history.append("committed", 2, "step_2", tier="local", validated=True)
    assert [e["name"] for e in history.read()] == ["step_1", "step_2"]
    assert history.validated_names() == {"step_2"}


def test_a_manager_starts_on_a_root_whose_history_tail_is_torn(tmp_path: Path) -> None:
    import torch

    from dcp_safe import CheckpointManager

    with CheckpointManager(tmp_path, keep_last=3) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(b'{"event": "comm')
    with CheckpointManager(tmp_path, keep_last=3) as ckpt:
        handle = ckpt.save(2, {"w": torch.ones(2)})
        assert handle is not None
        handle.committed.result(timeout=60)
    events = [(e["event"], e["step"]) for e in History(open_backend(str(tmp_path))).read()]
    assert ("committed", 1) in events and ("committed", 2) in events
