"""``BudgetedStager.track(keep=...)``: one kept generation, inside the envelope, never in flight.

Real DCP async saves into real folders; the kept generation is what the manager's in-memory tier
rolls back from (tests/manager/test_in_memory.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_safe.staging import BudgetedStager, MemoryBudget, StagerOptions

MiB = 1 << 20


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g), "s": seed}


def _save(stager: BudgetedStager, state: dict[str, Any], path: Path, keep: object) -> Any:
    response = dcp.async_save(
        state, storage_writer=FileSystemWriter(str(path)), async_stager=stager, no_dist=True
    )
    stager.track(response, keep=keep)
    return response


def _stager() -> BudgetedStager:
    return BudgetedStager(
        MemoryBudget(usable_bytes=64 * MiB, reserve_bytes=0), options=StagerOptions(timeout_s=30)
    )


def test_a_successful_upload_is_kept_under_its_tag_and_replaces_the_one_before(
    tmp_path: Path,
) -> None:
    with _stager() as stager:
        assert stager.kept() is None
        first = _state(1)
        _save(stager, first, tmp_path / "a", keep="a").upload_completion.result()
        tag, kept = stager.kept()  # type: ignore[misc]
        assert tag == "a" and torch.equal(kept["w"], first["w"]) and kept["s"] == 1
        assert kept["w"].data_ptr() != first["w"].data_ptr()  # the staged copy, not the source
        stats = stager.stats()
        assert stats.in_flight == 0 and stats.kept_bytes == stats.in_use_bytes > 0

        second = _state(2)
        _save(stager, second, tmp_path / "b", keep="b").upload_completion.result()
        tag, kept = stager.kept()  # type: ignore[misc]
        assert tag == "b" and torch.equal(kept["w"], second["w"])
        del kept
        # Only the newest is kept: the first copy's buffers went back to the pool.
        stats = stager.stats()
        assert stats.kept_bytes == stats.in_use_bytes and stats.free_bytes > 0


def test_the_third_kept_save_allocates_nothing(tmp_path: Path) -> None:
    with _stager() as stager:
        for i in range(3):
            _save(stager, _state(i), tmp_path / str(i), keep=i).upload_completion.result()
        assert stager.stats().last_allocated_bytes == 0  # two generations' buffers, reused


def test_a_failed_upload_leaves_the_kept_generation_alone(tmp_path: Path) -> None:
    with _stager() as stager:
        _save(stager, _state(1), tmp_path / "ok", keep="ok").upload_completion.result()
        blocker = tmp_path / "a_file"
        blocker.write_text("not a folder")
        failed = _save(stager, _state(2), blocker / "under", keep="bad")
        with pytest.raises(BaseException):  # noqa: B017 - whatever DCP raises for the folder
            failed.upload_completion.result()
        tag, kept = stager.kept()  # type: ignore[misc]
        assert tag == "ok" and kept["s"] == 1
        del kept, failed
        stats = stager.stats()
        assert stats.in_flight == 0 and stats.kept_bytes == stats.in_use_bytes


def test_drop_kept_and_close_give_the_buffers_back(tmp_path: Path) -> None:
    stager = _stager()
    _save(stager, _state(1), tmp_path / "a", keep="a").upload_completion.result()
    stager.drop_kept()
    assert stager.kept() is None and stager.stats().in_use_bytes == 0
    _save(stager, _state(2), tmp_path / "b", keep="b").upload_completion.result()
    stager.close()  # a kept generation does not make close() wait or fail
    assert stager.kept() is None


def test_without_keep_nothing_is_kept(tmp_path: Path) -> None:
    with _stager() as stager:
        _save(stager, _state(1), tmp_path / "a", keep=None).upload_completion.result()
        assert stager.kept() is None and stager.stats().in_use_bytes == 0
