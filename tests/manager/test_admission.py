"""Nothing waits forever: ``when_busy="wait"`` is bounded, and a stuck save stops admission.

A writer held at its first item keeps a save in flight for as long as the test wants (released
at the end, so every save finishes), which makes "busy" deterministic without timing guesses.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_safe import (
    Bounds,
    CheckpointManager,
    Runtime,
    SafeStorageWriter,
    SavePolicy,
    list_checkpoints,
)
from dcp_safe.errors import AdmissionTimeoutError
from dcp_safe.manager.fallback import MemoryWatch


class _HeldWriter(SafeStorageWriter):
    """Blocks every item write until ``release`` is set (bounded, so a failed test ends)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def _write_item(self, sink: Any, file_name: str, item: Any, planner: Any) -> Any:
        self.release.wait(timeout=60)
        return super()._write_item(sink, file_name, item, planner)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((128,), float(step))}


def test_a_wait_past_wait_timeout_skips_and_says_why(tmp_path: Path) -> None:
    writer = _HeldWriter(str(tmp_path / "ckpt"))
    manager = CheckpointManager(
        writer.root,
        when_busy="wait",
        bounds=Bounds(wait_timeout_s=0.3),
        runtime=Runtime(writer=writer),
    )
    try:
        assert manager.save(1, _state(1)) is not None  # in flight, held
        assert manager.save(2, _state(2)) is None  # waited 0.3 s, then skipped
        with pytest.raises(AdmissionTimeoutError, match="wait_timeout_s"):
            manager.save(3, _state(3), force=True)  # a save that must not be lost says so
        stats = manager.stats()
        assert stats.waits_expired == 2
        assert stats.skipped == 2
        assert stats.waited_s > 0
    finally:
        writer.release.set()
        manager.close(timeout_s=60)
    skipped = [e for e in manager.history() if e["event"] == "skipped"]
    assert [e["step"] for e in skipped] == [2, 3]
    assert all("wait_timeout_s" in e["reason"] for e in skipped)
    assert [c.step for c in list_checkpoints(writer.root)] == [1]


def test_a_save_in_flight_past_its_latency_objective_skips_requests_at_once(
    tmp_path: Path,
) -> None:
    writer = _HeldWriter(str(tmp_path / "ckpt"))
    manager = CheckpointManager(
        writer.root,
        when_busy="wait",
        policy=SavePolicy(latency_objective_s=0.2),
        runtime=Runtime(writer=writer),
    )
    try:
        manager.save(1, _state(1))
        time.sleep(0.4)  # the held save is now older than its objective (it only ages)
        assert manager.save(2, _state(2)) is None
        stats = manager.stats()
        assert stats.skipped == 1
        assert stats.waits_expired == 0  # skipped without waiting behind the stuck save
    finally:
        writer.release.set()
        manager.close(timeout_s=60)
    (skipped,) = [e for e in manager.history() if e["event"] == "skipped"]
    assert "latency_objective_s=0.2" in skipped["reason"]


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "5", True])
def test_bounds_must_be_positive_finite_seconds(tmp_path: Path, value: Any) -> None:
    from dcp_safe import ConfigError

    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path / "a", bounds=Bounds(wait_timeout_s=value))
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path / "b", policy=SavePolicy(latency_objective_s=value))


def test_the_memory_watch_reports_the_lowest_reading_since_it_was_last_asked() -> None:
    readings = iter([900, 300, 700, 800] + [1000] * 10_000)
    gate = threading.Semaphore(0)

    def sample() -> int:
        gate.release()
        return next(readings)

    watch = MemoryWatch(sample, interval_s=0.01)
    try:
        for _ in range(3):  # three background readings: 900, 300, 700
            gate.acquire(timeout=10)
        time.sleep(0.05)
        low = watch.lowest()  # and one fresh reading now
        assert low == 300
        assert watch.lowest() == 1000  # the dip was reported once
    finally:
        watch.close()
