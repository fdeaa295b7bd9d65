"""``SavePolicy(auto=True)`` under a real gloo group: the ranks measure different costs and
choose one interval, the slowest rank's, on every rank.

Each rank's clock is a test clock the test advances (a step is 1 s; a save stalls rank 0 1 s
and rank 1 9 s more, advanced after the save committed, so the time to durable commit measures
0 s on both): the costs, the interval and the steps saved are exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.clocks import SkewedClock

from dcp_safe import Bounds, CheckpointManager, Runtime, SavePolicy
from dcp_safe.manager.cadence import young_daly_s
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

STALL_S = (1.0, 9.0)  # what a save costs each rank
MTBF_S = 50.0


def _auto(rank: int, world_size: int, root: str) -> dict[str, Any]:
    clock = SkewedClock(start=rank * 1e5)
    policy = SavePolicy(auto=True, mtbf_s=MTBF_S)
    saved = []
    with CheckpointManager(
        root, policy=policy, bounds=Bounds(deadline_s=20.0), runtime=Runtime(clock=clock)
    ) as manager:
        for step in range(1, 81):
            clock.advance(1.0)
            handle = manager.maybe_save(step, {f"rank{rank}.w": torch.full((64,), float(step))})
            if handle is not None:
                saved.append(step)
                handle.committed.result(timeout=120)
                manager.wait(timeout_s=120)
                clock.advance(STALL_S[rank])
    return {"saved": saved, "stats": manager.stats(), "decisions": manager.decisions()}


def test_auto_chooses_one_interval_from_the_slowest_ranks_costs(tmp_path: Path) -> None:
    results = run_ranks(_auto, 2, args=(str(tmp_path),), timeout_s=240)
    interval = young_daly_s(max(STALL_S), MTBF_S)  # 30 s; rank 0's own costs would give 10 s
    for result in results:
        stats = result["stats"]
        assert stats.save_cost_s == max(STALL_S) and stats.save_interval_s == interval
        # The first save measures the costs; then 30 s after each commit, on rank 0's clock
        # (steps of 1 s, its saves 1 s longer).
        assert result["saved"] == [1, 30, 59]
        assert result["decisions"] == results[0]["decisions"]
