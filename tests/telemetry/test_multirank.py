"""Two gloo ranks: each records its own spans with its rank; only the coordinator commits.

Opt-in (``DCP_SAFE_LONG=1``): spawning two ranks costs 10-25 s on a loaded 2-core machine, more
than this suite's whole default budget; the single-process tests cover every other path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_safe.testing.multiproc import run_ranks

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DCP_SAFE_LONG") != "1", reason="opt-in: DCP_SAFE_LONG=1"),
]


def _save_with_telemetry(rank: int, world_size: int, root: str) -> list[tuple[Any, ...]]:
    from dcp_safe.adapters import api
    from dcp_safe.adapters.writer import SafeStorageWriter
    from dcp_safe.telemetry import Telemetry

    with Telemetry(sample_memory=False) as tel:
        writer = tel.wrap_writer(SafeStorageWriter(root, step=1))
        state = {f"rank{rank}": torch.full((64,), float(rank))}
        api.save(state, checkpoint_id="step_1", storage_writer=writer)
        return [(e.kind.value, e.name, e.rank, e.save, e.ok, e.bytes) for e in tel.memory.events()]


def test_each_rank_records_its_spans_and_only_rank_0_commits(tmp_path: Path) -> None:
    per_rank = run_ranks(_save_with_telemetry, 2, args=(str(tmp_path),))
    for rank, events in enumerate(per_rank):
        assert {e[2] for e in events} == {rank}
        assert {e[3] for e in events} == {"step_1"}
        ends = {e[1]: e for e in events if e[0] == "span_end"}
        assert all(e[4] for e in ends.values())
        assert ends["write"][5] is not None and ends["write"][5] > 0
        expected = {"save", "plan", "write", "commit"} if rank == 0 else {"save", "plan", "write"}
        assert set(ends) == expected
