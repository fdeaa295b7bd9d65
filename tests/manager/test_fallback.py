"""Automatic fallback to synchronous saves: the pure monitor, then each trigger on a manager.

Clocks and memory samplers are injected: nothing here depends on real time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import make_state

from dcp_safe import Bounds, Runtime, SavePolicy
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.errors import ConfigError
from dcp_safe.manager import CheckpointManager
from dcp_safe.manager.fallback import FallbackMonitor, FallbackOptions
from dcp_safe.staging import BudgetedStager, MemoryBudget, StagerStats

_TIMEOUT_S = 120  # a safety net against a hang, never an assertion
_RESERVE = 1000


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- the pure monitor


def test_two_memory_crossings_within_the_window_trip() -> None:
    monitor = FallbackMonitor(FallbackOptions(memory_window_s=100), reserve_bytes=_RESERVE)
    assert monitor.on_request(0, 500) is None  # crossing 1
    assert monitor.on_request(1, 400) is None  # still below: not a new crossing
    assert monitor.on_request(2, 5000) is None
    reason = monitor.on_request(3, 999)  # crossing 2
    assert reason is not None and "2 times" in reason and monitor.tripped


def test_memory_crossings_outside_the_window_are_forgotten() -> None:
    monitor = FallbackMonitor(FallbackOptions(memory_window_s=100), reserve_bytes=_RESERVE)
    monitor.on_request(0, 500)
    monitor.on_request(50, 5000)
    assert monitor.on_request(101, 500) is None  # the first crossing left the window
    assert not monitor.tripped


def test_p99_over_two_measured_intervals_trips() -> None:
    options = FallbackOptions(latency_window=4, min_completed=3)
    monitor = FallbackMonitor(options, reserve_bytes=0)
    for t in (0.0, 1.0, 2.0, 3.0):
        monitor.on_request(t, None)
    assert monitor.interval_s() == 1.0
    assert monitor.on_completed(1.5) is None
    assert monitor.on_completed(2.5) is None  # too few completions yet
    reason = monitor.on_completed(1.0)
    assert reason is not None and "p99 2.500 s" in reason


def test_p99_within_two_configured_intervals_does_not_trip() -> None:
    options = FallbackOptions(save_interval_s=10.0, latency_window=3, min_completed=1)
    monitor = FallbackMonitor(options, reserve_bytes=0)
    for duration in (5.0, 19.0, 20.0, 1.0):
        assert monitor.on_completed(duration) is None
    assert monitor.on_completed(20.5) is not None


def test_idle_in_use_bytes_trip_and_rearm_forgets() -> None:
    monitor = FallbackMonitor(FallbackOptions(), reserve_bytes=0)
    assert monitor.on_idle(0) is None
    assert monitor.on_idle(4096) is not None
    assert monitor.on_idle(4096) is None  # tripped already: reported once
    monitor.rearm()
    assert not monitor.tripped and monitor.reason is None


def test_disabled_never_trips() -> None:
    monitor = FallbackMonitor(FallbackOptions(enabled=False), reserve_bytes=_RESERVE)
    for t in range(6):
        monitor.on_request(float(t), 0 if t % 2 else 5000)
    assert monitor.on_idle(1) is None and not monitor.tripped


@pytest.mark.parametrize(
    "kwargs",
    [
        {"memory_window_s": 0},
        {"memory_crossings": 0},
        {"min_completed": 30},
        {"save_interval_s": 0},
    ],
)
def test_bad_options_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        FallbackOptions(**kwargs)


# ---------------------------------------------------------------- on a manager


class _ClockedWriter(SafeStorageWriter):
    """Every write takes ``write_s`` of the injected clock's time."""

    def __init__(self, root: Any, clock: _Clock, write_s: float = 0.0) -> None:
        super().__init__(root)
        self.clock = clock
        self.write_s = write_s

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.clock.now += self.write_s
        return super().write_data(plan, planner)


class _LeakyStager(BudgetedStager):
    """Reports in-use bytes that no generation owns once ``leak`` is set."""

    leak = 0

    def stats(self) -> StagerStats:
        real = super().stats()
        return dataclasses.replace(real, in_use_bytes=real.in_use_bytes + self.leak)


def _manager(
    root: Path,
    clock: _Clock,
    *,
    write_s: float = 0.0,
    samples: Iterator[int] | None = None,
    stager: BudgetedStager | None = None,
    **options: Any,
) -> CheckpointManager:
    budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=_RESERVE)
    return CheckpointManager(
        root,
        keep_last=10,
        policy=SavePolicy(sync_fallback=FallbackOptions(**options)),
        bounds=Bounds(budget=None if stager else budget),
        runtime=Runtime(
            writer=_ClockedWriter(root, clock, write_s),
            stager=stager,
            memory_sampler=(lambda: next(samples)) if samples else (lambda: 1 << 30),
            clock=clock,
        ),
    )


def _save_all(manager: CheckpointManager, steps: range) -> None:
    for step in steps:
        manager.save(step, make_state(step))
        manager.wait(_TIMEOUT_S)


def _fallbacks(manager: CheckpointManager) -> list[dict[str, Any]]:
    return [e for e in manager.history() if e["event"] == "fallback"]


def test_memory_dipping_under_the_reserve_twice_switches_to_sync(tmp_path: Path) -> None:
    samples = iter([5000, 500, 5000, 500, 5000, 5000])
    with _manager(tmp_path, _Clock(), samples=samples) as manager:
        _save_all(manager, range(1, 4))
        assert manager.stats().sync_saves == 0
        _save_all(manager, range(4, 6))  # the 2nd dip comes with step 4's request
        stats = manager.stats()
        assert (stats.started, stats.sync_saves, stats.committed) == (3, 2, 5)
        assert stats.fallback_reason is not None and "reserve" in stats.fallback_reason
        [event] = _fallbacks(manager)
        assert event["step"] == 4 and "2 times" in event["reason"]


def test_slow_completions_switch_to_sync(tmp_path: Path) -> None:
    clock = _Clock()
    manager = _manager(
        tmp_path, clock, write_s=5.0, save_interval_s=1.0, latency_window=4, min_completed=2
    )
    with manager:
        _save_all(manager, range(1, 3))  # p99 5 s > 2 x 1 s once two are in
        assert _fallbacks(manager) == []  # tripped by step 2's commit: acted on at the next
        _save_all(manager, range(3, 5))
        # Recorded at the request where the ranks' agreed decision first says so, which is the
        # same request on every rank (a latency trips each rank at its own moment).
        [event] = _fallbacks(manager)
        assert event["step"] == 3 and "p99 5.000 s" in event["reason"]
        stats = manager.stats()
        assert (stats.started, stats.sync_saves, stats.committed) == (2, 2, 4)


def test_buffers_outliving_their_save_switch_to_sync(tmp_path: Path) -> None:
    stager = _LeakyStager(MemoryBudget(usable_bytes=1 << 30, reserve_bytes=_RESERVE))
    with _manager(tmp_path, _Clock(), stager=stager) as manager:
        _save_all(manager, range(1, 3))
        stager.leak = 4096  # as if generation 2's buffers were never released
        _save_all(manager, range(3, 5))
        stats = manager.stats()
        assert (stats.started, stats.sync_saves) == (2, 2)
        [event] = _fallbacks(manager)
        assert event["step"] == 3 and "4096 B still in use" in event["reason"]
    stager.close()


def test_rearm_switches_back_to_async(tmp_path: Path) -> None:
    samples = iter([500, 5000, 500] + [5000] * 10)
    with _manager(tmp_path, _Clock(), samples=samples) as manager:
        _save_all(manager, range(1, 4))
        assert manager.stats().sync_saves == 1
        manager.rearm()
        assert manager.stats().fallback_reason is None
        _save_all(manager, range(4, 6))
        stats = manager.stats()
        assert (stats.started, stats.sync_saves, stats.committed) == (4, 1, 5)
        assert [e["event"] for e in manager.history() if e["event"] in ("fallback", "rearmed")] == [
            "fallback",
            "rearmed",
        ]


def test_disabled_fallback_keeps_saving_async(tmp_path: Path) -> None:
    samples = iter([500, 5000] * 5)
    with _manager(tmp_path, _Clock(), samples=samples, enabled=False) as manager:
        _save_all(manager, range(1, 6))
        assert (manager.stats().started, manager.stats().sync_saves) == (5, 0)
        assert _fallbacks(manager) == []


# ---------------------------------------------------------------- the argument's name


def test_the_removed_fallback_alias_names_its_replacement_and_that_works(tmp_path: Path) -> None:
    samples = iter([500, 5000] * 5)  # would trip the default thresholds at the 2nd dip
    budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=_RESERVE)
    moved = r"CheckpointManager\(fallback=\) moved to policy=SavePolicy\(sync_fallback=\.\.\.\)"
    with pytest.raises(ConfigError, match=moved):
        CheckpointManager(
            tmp_path,
            bounds=Bounds(budget=budget),
            fallback=FallbackOptions(enabled=False),
            runtime=Runtime(memory_sampler=lambda: next(samples), clock=_Clock()),
        )
    manager = CheckpointManager(
        tmp_path,
        policy=SavePolicy(sync_fallback=FallbackOptions(enabled=False)),
        bounds=Bounds(budget=budget),
        runtime=Runtime(memory_sampler=lambda: next(samples), clock=_Clock()),
    )
    with manager:
        _save_all(manager, range(1, 6))
        assert (manager.stats().started, manager.stats().sync_saves) == (5, 0)


def test_sync_fallback_and_the_removed_alias_together_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sync_fallback="):
        CheckpointManager(
            tmp_path,
            policy=SavePolicy(sync_fallback=FallbackOptions()),
            fallback=FallbackOptions(enabled=False),
        )
