"""``SafeStorageReader(load_budget_bytes=)``: a load holds at most the budget in transient bytes.

Transient bytes are what the reads allocate beyond the target state (stored bytes read before
they are copied, decompressed copies, tensors built to be narrowed). The reader counts them as
they are allocated (``memory_stats()``); every test here loads exactly and checks that count
against the budget, and an item larger than the whole budget is admitted alone, never deadlocked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal

import dcp_safe
from dcp_safe import (
    CheckpointManager,
    ConfigError,
    SafeStorageReader,
    SafeStorageWriter,
    WriterOptions,
)
from dcp_safe.checkpoints.items import TENSOR_ARCHIVE_BYTES

KIB, MIB = 1 << 10, 1 << 20
SMALL_BYTES = 256 * KIB  # read whole (below 1 MiB)
BIG_BYTES = 4 * MIB  # read in chunks, straight into its target when it can be


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {
        f"layers.{i}.weight": torch.randn(SMALL_BYTES // 4, generator=gen) for i in range(16)
    }
    state["big"] = torch.randn(BIG_BYTES // 4, generator=gen)
    state["wide"] = torch.randn(256, 512, generator=gen)  # loaded into a transposed target
    state["meta"] = {"step": 7, "names": [f"layer_{i}" for i in range(100)]}
    return state


def _targets(state: dict[str, Any]) -> dict[str, Any]:
    """Zeroed targets; ``wide`` is not contiguous, so it is read into a tensor, then copied."""
    target: dict[str, Any] = {
        key: torch.zeros_like(value) for key, value in state.items() if key != "meta"
    }
    target["wide"] = torch.zeros(512, 256).t()
    assert not target["wide"].is_contiguous()
    target["meta"] = {"step": 0, "names": []}
    return target


def _largest_item_bound() -> int:
    """What one item can hold, from the state alone: its stored bytes, plus a decompressed
    copy (or a tensor of the stored shape) of at most the tensor and torch's archive around
    it."""
    return 2 * (BIG_BYTES + TENSOR_ARCHIVE_BYTES)


@pytest.fixture(params=["none", "zstd"])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = _state()
    writer = SafeStorageWriter(
        tmp_path, options=WriterOptions(compression=request.param, thread_count=4, fsync=False)
    )
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)
    return tmp_path, state


def _load(root: Path, state: dict[str, Any], budget: int | None) -> SafeStorageReader:
    target = _targets(state)
    reader = SafeStorageReader(root, thread_count=4, load_budget_bytes=budget)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert_state_equal(target, state)
    return reader


def test_a_small_budget_loads_exactly_and_holds_at_most_the_budget_or_one_item(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, state = saved
    budget = 1 * MIB
    stats = _load(root, state, budget).memory_stats()
    assert stats.budget_bytes == budget
    assert stats.items_admitted > 0
    assert 0 < stats.largest_item_bytes <= _largest_item_bound()
    assert stats.peak_bytes <= max(budget, stats.largest_item_bytes), stats


def test_a_budget_of_one_byte_loads_one_item_at_a_time(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, state = saved
    stats = _load(root, state, 1).memory_stats()
    # Every item costs more than the budget, so each is admitted alone: the peak is one item's.
    assert stats.peak_bytes == stats.largest_item_bytes <= _largest_item_bound(), stats


def test_without_a_budget_the_reads_are_counted_but_not_bounded(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, state = saved
    reader = _load(root, state, None)
    stats = reader.memory_stats()
    assert reader.load_budget_bytes is None and stats.budget_bytes is None
    assert stats.peak_bytes >= stats.largest_item_bytes > 0


def test_each_reset_counts_the_next_load_afresh(saved: tuple[Path, dict[str, Any]]) -> None:
    root, state = saved
    reader = SafeStorageReader(root, load_budget_bytes=1)
    for _ in range(2):
        target = _targets(state)
        dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
        assert_state_equal(target, state)
        stats = reader.memory_stats()
        assert stats.peak_bytes == stats.largest_item_bytes > 0
    reader.reset("step_1")
    assert reader.memory_stats().peak_bytes == 0


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, "16MiB"])
def test_a_budget_that_is_not_a_positive_int_is_refused(tmp_path: Path, budget: Any) -> None:
    with pytest.raises(ConfigError, match="load_budget_bytes"):
        SafeStorageReader(tmp_path, load_budget_bytes=budget)


def test_the_manager_bounds_its_restores_by_the_staging_envelope(tmp_path: Path) -> None:
    state = {"w": torch.randn(1000), "meta": {"step": 3}}
    with CheckpointManager(tmp_path) as manager:
        handle = manager.save(3, state)
        assert handle is not None
        handle.committed.result(timeout=60)
        target: dict[str, Any] = {"w": torch.zeros(1000), "meta": {"step": 0}}
        manager.restore(target)
        assert_state_equal(target, state)
        reader = manager.last_reader
        assert reader is not None
        envelope = max(1, manager.stager.budget.envelope_bytes)
        assert reader.load_budget_bytes == envelope
        assert reader.memory_stats().budget_bytes == envelope
