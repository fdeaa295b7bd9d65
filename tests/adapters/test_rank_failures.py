"""A rank killed (SIGKILL) or hung (SIGSTOP) mid-save fails every survivor's save, typed, in time.

Each test launches real gloo ranks with ``run_ranks``. The victim rank writes the first item of
its shard and then kills or stops itself from inside the writer, so the save is really in
flight: bytes on storage, peers inside DCP's collectives. The survivors return what they saw
(``run_ranks`` hands their values back on the ``RankFailedError`` that names the victim); the
assertions run here. A fresh launch afterwards proves the job recovers: the next save commits.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from support import assert_state_equal, blank_tree, rank_union
from support.faults import DiesMidWrite

import dcp_safe
from dcp_safe import CommitError, SafeStorageReader, SafeStorageWriter, list_checkpoints
from dcp_safe.testing.multiproc import RankFailedError, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

# Long enough that a healthy save's collectives never hit it on a loaded machine, short enough
# that the SIGSTOP case stays quick: the survivors wait exactly this long for the stopped peer.
DEADLINE_S = 8.0
# The harness's own patience for survivors after the victim is gone: far above DEADLINE_S, so
# only a real hang (a survivor that never gets its error) trips it.
GRACE_S = 90.0


def _rank_state(rank: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return {
        f"rank{rank}.a": torch.randn(64, 32, generator=gen),
        f"rank{rank}.b": torch.randn(128, generator=gen),
        "shared.step": {"seed": seed},
    }


def _good_then_bad(
    rank: int, world_size: int, root: str, victim: int, signum: int, use_async: bool
) -> dict[str, Any]:
    Path(root).with_name(f"pid_{rank}").write_text(str(os.getpid()))
    dcp_safe.save(
        _rank_state(rank),
        checkpoint_id="good",
        storage_writer=SafeStorageWriter(root),
        deadline_s=DEADLINE_S,
    )
    writer = DiesMidWrite(root, victim=victim, signum=signum)
    started = time.monotonic()
    seen: dict[str, Any] = {"error": None}
    try:
        if use_async:
            dcp_safe.async_save(
                _rank_state(rank, seed=1),
                checkpoint_id="bad",
                storage_writer=writer,
                deadline_s=DEADLINE_S,
            ).result()
        else:
            dcp_safe.save(
                _rank_state(rank, seed=1),
                checkpoint_id="bad",
                storage_writer=writer,
                deadline_s=DEADLINE_S,
            )
    except CommitError as exc:
        seen = {
            "error": type(exc).__name__,
            "failures": exc.failures,
            "cause": type(exc.__cause__).__name__,
        }
    seen["seconds_to_error"] = time.monotonic() - started
    seen["listed"] = [info.name for info in list_checkpoints(root)]
    # Undistributed: the victim is gone, so no collective (not even creating a group) can run.
    target = blank_tree(rank_union(_rank_state, world_size))
    dcp_safe.load(
        target, checkpoint_id="latest", storage_reader=SafeStorageReader(root), no_dist=True
    )
    seen["latest"] = target
    return seen


def _save_after_restart(rank: int, world_size: int, root: str) -> None:
    dcp_safe.save(
        _rank_state(rank, seed=2),
        checkpoint_id="after_restart",
        storage_writer=SafeStorageWriter(root),
        deadline_s=DEADLINE_S,
    )


def _run_failing(
    root: Path, world_size: int, victim: int, signum: int, *, use_async: bool = False
) -> dict[int, dict[str, Any]]:
    """Run the save with a victim; return what each survivor saw."""
    with pytest.raises(RankFailedError) as caught:
        run_ranks(
            _good_then_bad,
            world_size,
            args=(str(root), victim, signum, use_async),
            timeout_s=240,
            failure_grace_s=GRACE_S,
        )
    assert caught.value.rank == victim
    assert set(caught.value.failures) == {victim}
    # The harness took the victim down too, stopped or not: no rank outlives run_ranks.
    pid = int(root.with_name(f"pid_{victim}").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    return caught.value.results


def _assert_failed_cleanly(
    root: Path, survivors: dict[int, dict[str, Any]], world_size: int, victim: int
) -> None:
    assert sorted(survivors) == [r for r in range(world_size) if r != victim]
    good = rank_union(_rank_state, world_size)
    for seen in survivors.values():
        assert seen["error"] == "CommitError"
        assert list(seen["failures"]) == [victim]
        assert seen["cause"] in {"RuntimeError", "DistBackendError", "DistNetworkError"}
        assert seen["listed"] == ["good"]
        assert_state_equal(seen["latest"], good)
    assert [info.name for info in list_checkpoints(root)] == ["good"]
    assert not (root / "bad").exists()


def _assert_recovers(root: Path, world_size: int) -> None:
    run_ranks(_save_after_restart, world_size, args=(str(root),), timeout_s=240)
    assert [info.name for info in list_checkpoints(root)] == ["good", "after_restart"]
    expected = rank_union(_rank_state, world_size, seed=2)
    target = blank_tree(expected)
    dcp_safe.load(target, checkpoint_id="after_restart", storage_reader=SafeStorageReader(root))
    assert_state_equal(target, expected)
    previous = blank_tree(rank_union(_rank_state, world_size))
    dcp_safe.load(previous, checkpoint_id="good", storage_reader=SafeStorageReader(root))
    assert_state_equal(previous, rank_union(_rank_state, world_size))


def test_a_rank_killed_mid_save_fails_the_survivor_with_a_commit_error_naming_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    survivors = _run_failing(root, 2, victim=1, signum=signal.SIGKILL)

    _assert_failed_cleanly(root, survivors, 2, victim=1)
    _assert_recovers(root, 2)


def test_a_rank_stopped_mid_async_save_fails_the_survivors_future_within_the_deadline(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    survivors = _run_failing(root, 2, victim=1, signum=signal.SIGSTOP, use_async=True)

    _assert_failed_cleanly(root, survivors, 2, victim=1)
    _assert_recovers(root, 2)


def test_a_killed_rank_among_four_is_named_by_every_survivor(tmp_path: Path) -> None:
    root = tmp_path / "run"
    survivors = _run_failing(root, 4, victim=2, signum=signal.SIGKILL)

    _assert_failed_cleanly(root, survivors, 4, victim=2)
