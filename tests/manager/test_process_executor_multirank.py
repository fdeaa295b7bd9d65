"""``Runtime(executor="process")`` on several ranks: the ranks' workers save over a gloo
group of their own, with every guarantee of the thread executor.

Real ranks (``run_ranks``, a real gloo default group), a real worker per rank, real files; a
worker is killed with a real SIGKILL from inside its own write (``DiesMidWrite``). Checked: the
saves of 2 ranks restore exactly, each rank keeps one worker and the coordinator's worker keeps
its cached plan; one rank's worker killed mid-save fails the save on both ranks with typed
errors that name it and publishes nothing, and the next save starts new workers on every rank
together and commits; one rank's torn snapshot fails the save on both ranks from inside the
workers' planning; close() leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, blank_like, checkpoint_workers, make_state, ready_worker
from support.faults import DiesMidWrite, RecordsPlans

from dcp_safe import Bounds, CheckpointManager, CommitError, Runtime, Topology, list_checkpoints
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.errors import DivergentStateError, SnapshotMutatedError
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.testing.staging import hold_staging

pytestmark = [pytest.mark.worker_process, pytest.mark.multiproc, pytest.mark.timeout(300)]

DEADLINE_S = 20.0
_TIMEOUT_S = 120  # a safety net against a hang, never an assertion


# What torch and Python name their POSIX shared memory (the staged copies themselves are memfds,
# never in /dev/shm); other programs of the host come and go there meanwhile.
_SHM_PREFIXES = ("torch_", "psm_", "sem.mp-", "dcp_safe")


def _shm() -> set[str]:
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if name.startswith(_SHM_PREFIXES)}


def _state(rank: int, step: int) -> dict[str, Any]:
    """Replicated entries and one of this rank's own."""
    state = make_state(step)
    state[f"rank{rank}"] = torch.full((512,), float(100 * rank + step))
    return state


def _committed(root: str) -> list[str]:
    return [info.name for info in list_checkpoints(root)]


def _seen_dead(manager: CheckpointManager) -> bool:
    """The manager has seen its worker die (a save started earlier would find it dead first,
    fail, and leave the replacement to the save after)."""
    worker = manager._runner.worker
    return worker is not None and worker._process is not None and worker._process.dead


def _worker_pid(manager: CheckpointManager) -> int | None:
    worker = manager._runner.worker
    return None if worker is None else worker.pid


# -- rank bodies ----------------------------------------------------------------------------


def _save_three_then_restore(rank: int, world_size: int, root: str, record: str) -> dict[str, Any]:
    writer = RecordsPlans(root, record=record)
    with CheckpointManager(
        root,
        keep_last=3,
        bounds=Bounds(deadline_s=DEADLINE_S),
        runtime=Runtime(writer=writer, executor="process"),
    ) as manager:
        pids = {ready_worker(manager)}
        for step in range(1, 4):
            handle = manager.save(step, _state(rank, step))
            assert handle is not None
            handle.committed.result(_TIMEOUT_S)
            pids.add(_worker_pid(manager))
        exact = {}
        for step in (1, 3):
            target = blank_like(_state(rank, step))
            manager.restore(target, step)
            assert_state_equal(target, _state(rank, step), f"rank {rank} step {step}")
            exact[step] = True
        running = checkpoint_workers()
    return {
        "pids": sorted(p for p in pids if p is not None),
        "running": running,
        "after_close": checkpoint_workers(),
        "exact": exact,
        "committed": _committed(root),
    }


def _killed_mid_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    writer = DiesMidWrite(root, victim=1, at_step=2)  # SIGKILLs rank 1's worker in step 2
    seen: dict[str, Any] = {}
    with CheckpointManager(
        root,
        keep_last=5,
        bounds=Bounds(deadline_s=DEADLINE_S),
        runtime=Runtime(writer=writer, executor="process"),
    ) as manager:
        ready_worker(manager)  # on the thread path its SIGKILL would hit the rank
        manager.save(1, _state(rank, 1)).committed.result(_TIMEOUT_S)
        first = _worker_pid(manager)
        handle = manager.save(2, _state(rank, 2))
        try:
            handle.committed.result(_TIMEOUT_S)
            seen["error"] = None
        except CommitError as exc:
            seen.update(error=type(exc).__name__, failures=sorted(exc.failures), text=str(exc))
        seen["committed_after_failure"] = _committed(root)
        target = blank_like(_state(rank, 1))
        manager.restore(target)
        assert_state_equal(target, _state(rank, 1), f"rank {rank} after the failed save")
        manager.save(3, _state(rank, 3)).committed.result(_TIMEOUT_S)
        seen["new_worker"] = _worker_pid(manager) not in (None, first)
        with contextlib.suppress(CommitError):
            manager.wait()  # the failure kept for the caller
        target = blank_like(_state(rank, 3))
        manager.restore(target, 3)
        assert_state_equal(target, _state(rank, 3), f"rank {rank} step 3")
    seen["after_close"] = checkpoint_workers()
    seen["committed"] = _committed(root)
    return seen


def _rank_1_tears_its_snapshot(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _state(rank, 1)
    seen: dict[str, Any] = {}
    with CheckpointManager(
        root, bounds=Bounds(deadline_s=DEADLINE_S), runtime=Runtime(executor="process")
    ) as manager:
        ready_worker(manager)
        if rank == 1:
            returned: list[Any] = []
            with hold_staging(manager.stager):
                saver = threading.Thread(target=lambda: returned.append(manager.save(1, state)))
                saver.start()
                deadline = time.monotonic() + _TIMEOUT_S
                while manager.stager.stats().admitted < 1 and time.monotonic() < deadline:
                    time.sleep(0.005)  # save(1) is blocked in its copy
                state[f"rank{rank}"].add_(1)
            saver.join(_TIMEOUT_S)
            [handle] = returned
        else:
            handle = manager.save(1, state)
        try:
            handle.committed.result(_TIMEOUT_S)
            seen["error"] = None
        except SnapshotMutatedError as exc:
            seen.update(error="SnapshotMutatedError", rank=exc.rank, fqns=list(exc.fqns))
        except BaseException as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"
        seen["listed"] = _committed(root)
        first = _worker_pid(manager)
        manager.save(2, _state(rank, 2)).committed.result(_TIMEOUT_S)
        seen["same_worker"] = _worker_pid(manager) == first
        with contextlib.suppress(SnapshotMutatedError):
            manager.wait()
        target = blank_like(_state(rank, 2))
        manager.restore(target)
        assert_state_equal(target, _state(rank, 2), f"rank {rank} step 2")
    seen["listed_after"] = _committed(root)
    return seen


# -- tests ----------------------------------------------------------------------------------


def test_two_ranks_save_in_their_workers_and_restore_exactly(tmp_path: Path) -> None:
    root, record = str(tmp_path / "ckpt"), str(tmp_path / "plans.txt")
    shm = _shm()
    results = run_ranks(_save_three_then_restore, 2, args=(root, record), timeout_s=240)
    for rank, seen in enumerate(results):
        assert len(seen["pids"]) == 1, (rank, seen)  # one worker per rank, started once
        assert seen["running"] == seen["pids"], (rank, seen)
        assert seen["after_close"] == [], (rank, seen)
        assert seen["exact"] == {1: True, 3: True}, (rank, seen)
        assert seen["committed"] == ["step_000000001", "step_000000002", "step_000000003"]
    assert results[0]["pids"] != results[1]["pids"]
    # The coordinator's worker planned the first save and reused that plan for the next two.
    first, *later = (int(n) for n in Path(record).read_text().split())
    assert first > 0 and later == [0, 0]
    assert _shm() == shm


def test_one_ranks_worker_killed_mid_save_fails_every_rank_and_the_next_save_restarts_all(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    shm = _shm()
    rank0, rank1 = run_ranks(_killed_mid_save, 2, args=(root,), timeout_s=240)
    assert rank1["error"] == "WorkerDiedError" and rank1["failures"] == [1], rank1
    assert "killed by signal 9" in rank1["text"]
    assert rank0["error"] == "CommitError" and rank0["failures"] == [1], rank0  # names rank 1
    for seen in (rank0, rank1):
        assert seen["committed_after_failure"] == ["step_000000001"], seen  # nothing published
        assert seen["new_worker"], seen  # every rank started a new worker, together
        assert seen["after_close"] == [], seen
        assert seen["committed"] == ["step_000000001", "step_000000003"], seen
    assert _shm() == shm


def test_one_ranks_torn_snapshot_fails_the_save_in_every_ranks_worker(tmp_path: Path) -> None:
    root = str(tmp_path)
    per_rank = run_ranks(_rank_1_tears_its_snapshot, 2, args=(root,), timeout_s=240)
    for rank, seen in enumerate(per_rank):
        assert seen["error"] == "SnapshotMutatedError", (rank, seen)
        assert seen["rank"] == 1 and seen["fqns"] == ["rank1"], (rank, seen)
        assert seen["listed"] == [], (rank, seen)
        assert seen["same_worker"], (rank, seen)  # no group broke: the workers are kept
        assert seen["listed_after"] == ["step_000000002"], (rank, seen)


def _node_local_saves(rank: int, world_size: int, nodes: list[str], remote: str) -> dict[str, Any]:
    node = nodes[rank]  # one rank per simulated node
    with CheckpointManager(
        Topology.of(remote, node_local=node),
        keep_last=2,
        bounds=Bounds(deadline_s=DEADLINE_S),
        runtime=Runtime(executor="process"),
    ) as manager:
        ready_worker(manager)
        for step in (1, 2, 3):
            handle = manager.save(step, _state(rank, step))
            assert handle is not None
            handle.committed.result(_TIMEOUT_S)  # the remote commit exists
        pid = _worker_pid(manager)
    with CheckpointManager(
        Topology.of(remote, node_local=node), runtime=Runtime(executor="process")
    ) as manager:
        target = blank_like(_state(rank, 3))
        name = manager.restore(target)
        assert_state_equal(target, _state(rank, 3), f"rank {rank} from its node cache")
        reader = manager.last_reader
    return {
        "pid": pid,
        "name": name,
        "from_cache": isinstance(reader, SafeStorageReader) and reader.stats().files_from_cache > 0,
        "after_close": checkpoint_workers(),
    }


def test_node_local_saves_run_in_the_workers_of_two_simulated_nodes(tmp_path: Path) -> None:
    nodes = [str(tmp_path / "node_a"), str(tmp_path / "node_b")]
    remote = str(tmp_path / "remote")
    per_rank = run_ranks(_node_local_saves, 2, args=(nodes, remote), timeout_s=240)
    for rank, seen in enumerate(per_rank):
        assert seen["pid"] is not None and seen["name"] == "step_000000003", (rank, seen)
        assert seen["from_cache"], (rank, seen)
        assert seen["after_close"] == [], (rank, seen)
    assert _committed(remote) == ["step_000000002", "step_000000003"]


def _divergent_on_a_cached_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with CheckpointManager(
        root, bounds=Bounds(deadline_s=DEADLINE_S), runtime=Runtime(executor="process")
    ) as manager:
        ready_worker(manager)
        manager.save(1, _state(rank, 1)).committed.result(_TIMEOUT_S)
        odd = _state(rank, 2)
        odd["f32"] = torch.full_like(odd["f32"], float(rank))  # replicated, differs by rank
        try:
            manager.save(2, odd).committed.result(_TIMEOUT_S)
            seen["error"] = None
        except DivergentStateError as exc:
            seen.update(error="DivergentStateError", keys=sorted(exc.keys))
        except BaseException as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(DivergentStateError):
            manager.wait()
        manager.save(3, _state(rank, 3)).committed.result(_TIMEOUT_S)
    seen["listed"] = _committed(root)
    return seen


def test_divergent_replicated_values_are_refused_in_every_ranks_worker(tmp_path: Path) -> None:
    per_rank = run_ranks(_divergent_on_a_cached_save, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, seen in enumerate(per_rank):
        assert seen["error"] == "DivergentStateError" and seen["keys"] == ["f32"], (rank, seen)
        assert seen["listed"] == ["step_000000001", "step_000000003"], (rank, seen)


def _killed_between_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    with CheckpointManager(
        root, bounds=Bounds(deadline_s=DEADLINE_S), runtime=Runtime(executor="process")
    ) as manager:
        ready_worker(manager)
        manager.save(1, _state(rank, 1)).committed.result(_TIMEOUT_S)
        first = _worker_pid(manager)
        assert first is not None
        if rank == 1:
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + _TIMEOUT_S
            while not _seen_dead(manager) and time.monotonic() < deadline:
                time.sleep(0.01)  # until this rank's manager knows (its reader thread)
        committed = manager.save(2, _state(rank, 2)).committed.result(_TIMEOUT_S)
        replaced = _worker_pid(manager) not in (None, first)
    return {"committed": committed, "replaced": replaced, "after_close": checkpoint_workers()}


def test_a_worker_killed_between_saves_is_replaced_on_every_rank_before_the_next(
    tmp_path: Path,
) -> None:
    per_rank = run_ranks(_killed_between_saves, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, seen in enumerate(per_rank):
        assert seen == {"committed": "step_000000002", "replaced": True, "after_close": []}, rank
