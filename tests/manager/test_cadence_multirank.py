"""Timed cadences under real gloo groups, every rank on its own skewed clock.

Each rank's ``Runtime.clock`` is a test clock with its own origin and rate (one stands still,
one runs four times fast): a rank deciding from its own clock would save at other steps than its
peers, and the save's vote would then fail with ranks at different steps. The clocks advance
only when the test says, so the interval cadence's steps are exact; the continuous cadence runs
against storage slow on one rank, where what is in flight at each step is up to the scheduler,
and only agreement can be checked (and that nothing was requested while a save was in flight).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.clocks import SkewedClock
from support.faults import SlowOnRank

from dcp_safe import Bounds, CheckpointManager, Runtime, SavePolicy
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

DEADLINE_S = 20.0
STEPS = 30
# Rank 0's clock decides; rank 1's stands still, rank 2's runs 4x fast, rank 3's at a quarter.
RATES = (1.0, 0.0, 4.0, 0.25)


def _clock(rank: int) -> SkewedClock:
    return SkewedClock(start=rank * 1e5, rate=RATES[rank])


def _interval(rank: int, world_size: int, root: str) -> dict[str, Any]:
    clock = _clock(rank)
    policy = SavePolicy(interval_s=10)
    runtime = Runtime(clock=clock)
    saved = []
    with CheckpointManager(
        root, policy=policy, bounds=Bounds(deadline_s=DEADLINE_S), runtime=runtime
    ) as manager:
        for step in range(1, STEPS + 1):
            clock.advance(1.0)
            handle = manager.maybe_save(step, {f"rank{rank}.w": torch.full((64,), float(step))})
            if handle is not None:
                saved.append(step)
                handle.committed.result(timeout=120)
                manager.wait(timeout_s=120)  # the commit restarted the interval on every rank
    return {"saved": saved, "reads": clock.reads, "decisions": manager.decisions()}


def _continuous(rank: int, world_size: int, root: str) -> dict[str, Any]:
    clock = _clock(rank)
    writer = SlowOnRank(root, slow_rank=world_size - 1, delay_s=0.2)
    policy = SavePolicy(continuous=True, min_interval_s=3, when_busy="wait")
    runtime = Runtime(writer=writer, clock=clock)
    saved = []
    with CheckpointManager(
        root, policy=policy, bounds=Bounds(deadline_s=DEADLINE_S), runtime=runtime
    ) as manager:
        for step in range(1, STEPS + 1):
            clock.advance(1.0)
            if manager.maybe_save(step, {f"rank{rank}.w": torch.full((64,), float(step))}):
                saved.append(step)
            time.sleep(0.05)  # a training step: the save in flight moves on meanwhile
    events = [(e["event"], e["step"]) for e in manager.decisions()]
    return {"saved": saved, "stats": manager.stats(), "events": events}


@pytest.mark.parametrize("world_size", [2, 4])
def test_interval_decides_alike_on_every_rank_whatever_its_clock(
    tmp_path: Path, world_size: int
) -> None:
    results = run_ranks(_interval, world_size, args=(str(tmp_path),), timeout_s=240)
    # Rank 0's clock: 10 s after the start, then 10 s after each commit. Rank 2 alone would have
    # saved every 3 steps, rank 1 never.
    for result in results:
        assert result["saved"] == [10, 20, 30]
        assert result["decisions"] == results[0]["decisions"]
        # One read per vote and a few per save: no rank polls its clock, or waits on another's.
        assert result["reads"] <= 2 * STEPS, result["reads"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_continuous_decides_alike_on_every_rank_with_one_rank_slow(
    tmp_path: Path, world_size: int
) -> None:
    results = run_ranks(_continuous, world_size, args=(str(tmp_path),), timeout_s=240)
    saved = results[0]["saved"]
    assert saved[0] == 1 and len(saved) >= 2  # none in flight at first; the next once committed
    assert all(b - a >= 3 for a, b in itertools.pairwise(saved))  # min_interval_s
    for result in results:
        assert result["saved"] == saved
        assert result["events"] == results[0]["events"]
        stats = result["stats"]
        # Never requested while one was in flight: nothing skipped, no wait, all committed.
        assert (stats.requested, stats.skipped, stats.committed) == (len(saved), 0, len(saved))
        assert stats.waited_s == 0.0
