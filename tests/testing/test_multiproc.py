"""``run_ranks``: results in rank order, a failing rank named, a hung rank killed with its tree."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from dcp_safe.errors import DcpSafeError
from dcp_safe.testing.multiproc import RankFailedError, RanksTimeoutError, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


# Rank functions live at module level: run_ranks pickles them by reference.


def _rank_report(rank: int, world_size: int, tag: str) -> dict[str, object]:
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "group_rank": dist.get_rank(),
        "group_size": dist.get_world_size(),
        "sum": int(total.item()),
        "tag": tag,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]),
        "tensor": torch.arange(3) * rank,
    }


def _start_sleeper(pid_dir: str, rank: int) -> int:
    """A non-daemon descendant, as DCP's PROCESS checkpointer starts one per rank."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(pid_dir, f"rank{rank}.pids").write_text(f"{os.getpid()} {sleeper.pid}")
    return sleeper.pid


def _leave_sleepers_behind(rank: int, world_size: int, pid_dir: str) -> tuple[int, int]:
    return os.getpid(), _start_sleeper(pid_dir, rank)


def _raise_on_rank_1(rank: int, world_size: int, pid_dir: str) -> str:
    if rank == 1:
        _start_sleeper(pid_dir, rank)
        raise ValueError("boom on rank 1")
    # Rank 0 waits in a collective that rank 1 never joins: the harness must not wait for it
    # until the run's deadline.
    dist.barrier()
    return "unreachable"


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _hang_on_rank_1(rank: int, world_size: int, pid_dir: str) -> int:
    Path(pid_dir, f"rank{rank}.pids").write_text(str(os.getpid()))
    while rank == 1:
        time.sleep(1)
    return rank


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pids(pid_dir: Path, rank: int) -> list[int]:
    return [int(p) for p in (pid_dir / f"rank{rank}.pids").read_text().split()]


def test_returns_each_ranks_value_in_rank_order() -> None:
    results = run_ranks(_rank_report, 2, args=("hello",))

    assert [r["rank"] for r in results] == [0, 1]
    for rank, result in enumerate(results):
        assert result["group_rank"] == rank
        assert result["world_size"] == result["group_size"] == 2
        assert result["sum"] == 1 + 2  # a real all_reduce over both ranks
        assert result["tag"] == "hello"
        assert result["env"] == (str(rank), "2", "127.0.0.1")
        assert torch.equal(result["tensor"], torch.arange(3) * rank)


def test_nothing_a_rank_started_outlives_run_ranks(tmp_path: Path) -> None:
    results = run_ranks(_leave_sleepers_behind, 2, args=(str(tmp_path),))

    assert [_pids(tmp_path, rank) for rank in (0, 1)] == [list(r) for r in results]
    assert all(_gone(pid) for result in results for pid in result)


def test_a_rank_exception_is_raised_in_the_parent_naming_the_rank(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_on_rank_1, 2, args=(str(tmp_path),))

    error = info.value
    assert isinstance(error, DcpSafeError)
    assert error.rank == 1
    assert error.exc_type == "builtins.ValueError"
    assert isinstance(error.exception, ValueError)
    assert str(error.exception) == "boom on rank 1"
    assert "rank 1 failed: builtins.ValueError: boom on rank 1" in str(error)
    # The remote traceback points at the line in the rank function, and is the cause.
    assert "_raise_on_rank_1" in error.remote_traceback
    assert 'raise ValueError("boom on rank 1")' in error.remote_traceback
    assert error.remote_traceback in str(error.__cause__)
    # Rank 0, stuck in a barrier its peer never reached, either failed too or was killed,
    # but rank 1 is named: it failed first.
    assert set(error.failures) == {0, 1}
    assert all(_gone(pid) for pid in _pids(tmp_path, 1))  # the rank and its sleeper


def test_a_rank_that_dies_without_a_result_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_exit_on_rank_1, 2)

    assert info.value.rank == 1
    assert info.value.exit_code == 3
    assert info.value.failures == {1: "process died with exit code 3 and no result"}


# Ranks start in well under a second (forked from a preloaded server): 4 s is a deadline.
HANG_DEADLINE_S = 4


def test_a_hung_rank_is_killed_at_the_deadline(tmp_path: Path) -> None:
    with pytest.raises(RanksTimeoutError) as info:
        run_ranks(_hang_on_rank_1, 2, args=(str(tmp_path),), timeout_s=HANG_DEADLINE_S)

    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, DcpSafeError)
    assert info.value.timeout_s == HANG_DEADLINE_S
    # Rank 1 never returns. (Rank 0 returns and waits for it; on a machine too busy to start
    # both ranks within the deadline it is named too, which is also the truth.)
    assert 1 in info.value.ranks
    assert f"still running after {HANG_DEADLINE_S}s" in str(info.value)
    # Every rank is gone (ranks are the fork server's children, not this process's).
    assert all(_gone(pid) for rank in (0, 1) for pid in _pids(tmp_path, rank))


def test_a_function_that_does_not_pickle_fails_before_anything_is_spawned() -> None:
    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_ranks(lambda rank, world_size: rank, 2)
