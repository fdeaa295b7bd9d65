"""No save waits for a checkpoint worker to start (issue 43, finding 2).

The first save request starts the worker without waiting for it; until every rank's worker is
ready (the first one, and every replacement after a death) the ranks agree to save on the
thread path. Real managers, real workers; a worker held from birth with a real SIGSTOP (so it
can never become ready until the test lets it: a save that waited for it would never commit),
killed with a real SIGKILL; two real gloo ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support import make_state, ready_worker

from dcp_safe import Bounds, CheckpointManager, FallbackOptions, Runtime, SavePolicy
from dcp_safe.coordination.agreement import Vote
from dcp_safe.coordination.groups import WORKERS
from dcp_safe.manager.handles import BusyPolicy
from dcp_safe.manager.saving import decide
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.worker import parent as worker_module
from dcp_safe.worker.parent import SaveWorker, _Process

pytestmark = pytest.mark.worker_process  # "auto" keeps choosing the worker here

_TIMEOUT_S = 120  # a safety net against a hang, never an assertion


@pytest.fixture
def held_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every checkpoint worker started from now on is SIGSTOPped as it is started, long before
    its imports end; the pids, in order. The test lets one go with ``SIGCONT``; all are let go
    at the end."""
    held: list[int] = []
    started = SaveWorker._started

    def holding(self: SaveWorker) -> Any:
        process = started(self)
        if process.popen.pid not in held:
            os.kill(process.popen.pid, signal.SIGSTOP)
            held.append(process.popen.pid)
        return process

    monkeypatch.setattr(SaveWorker, "_started", holding)
    try:
        yield held
    finally:
        for pid in held:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)


def _save(manager: CheckpointManager, step: int) -> str:
    handle = manager.save(step, make_state(step))
    assert handle is not None
    return handle.committed.result(_TIMEOUT_S)


@pytest.mark.parametrize("executor", ["auto", "process"])
def test_saves_run_on_a_thread_until_the_worker_is_ready_then_in_it(
    tmp_path: Path, executor: str, held_workers: list[int]
) -> None:
    with CheckpointManager(
        tmp_path, when_busy="wait", runtime=Runtime(executor=executor)
    ) as manager:
        assert manager.executor == "process"
        worker = manager._runner.worker
        assert worker is not None and worker.pid is None  # started by the first save request
        first = manager.save(1, make_state(1))
        second = manager.save(2, make_state(2))  # asked while the first is (or was) in flight
        assert first is not None and second is not None
        # Both committed on a thread while the worker they started is still held at birth.
        assert first.committed.result(_TIMEOUT_S) == "step_000000001"
        assert second.committed.result(_TIMEOUT_S) == "step_000000002"
        assert held_workers == [worker.pid] and not worker.ready
        assert manager.stats().worker_saves == 0
        os.kill(held_workers[0], signal.SIGCONT)
        ready_worker(manager)
        assert _save(manager, 3) == "step_000000003"
        assert held_workers == [worker.pid]  # no second worker: the first one saved
        stats = manager.stats()
        assert (stats.worker_saves, stats.committed) == (1, 3)
        assert (stats.sync_saves, stats.fallback_reason) == (0, None)
        # Only the worker's save was fed to the fallback: the two on a thread ran while it
        # started, which the fallback never counts (test_the_fallback_never_counts_...).
        assert len(manager._switch.monitor._durations) == 1


def test_after_a_worker_dies_saves_run_on_a_thread_until_its_replacement_is_ready(
    tmp_path: Path, held_workers: list[int]
) -> None:
    with CheckpointManager(tmp_path, keep_last=5, runtime=Runtime(executor="process")) as manager:
        manager.save(1, make_state(1)).committed.result(_TIMEOUT_S)  # on a thread; starts one
        os.kill(held_workers[0], signal.SIGCONT)
        first = ready_worker(manager)
        assert _save(manager, 2) == "step_000000002"
        assert manager.stats().worker_saves == 1
        os.kill(first, signal.SIGKILL)
        psutil.Process(first).wait(_TIMEOUT_S)
        # Its replacement, started by the next request, is held: these would wait on it.
        assert [_save(manager, step) for step in (3, 4)] == ["step_000000003", "step_000000004"]
        assert len(held_workers) == 2 and manager.stats().worker_saves == 1
        os.kill(held_workers[1], signal.SIGCONT)
        assert ready_worker(manager) == held_workers[1]
        assert _save(manager, 5) == "step_000000005"
        stats = manager.stats()
        assert (stats.worker_saves, stats.committed, stats.failed) == (2, 5, 0)
        assert (stats.sync_saves, stats.fallback_reason) == (0, None)


def test_a_worker_whose_process_exited_is_not_ready_before_any_thread_has_seen_it(
    tmp_path: Path, held_workers: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its keeper thread reaps it and its reader learns of its end only when they are next
    # scheduled; on a loaded host a save can be admitted before either runs. Both are held here
    # (the keeper holding Popen's wait lock as it does while it waits), so "ready" must come
    # from the process itself: a save routed to the dead worker would wait on its (held)
    # replacement.
    seen_end, keeping = threading.Event(), threading.Event()
    died = _Process.died

    def late_reader(self: _Process) -> None:
        seen_end.wait(_TIMEOUT_S)
        died(self)

    def late_keeper(command: list[str], fd: int) -> subprocess.Popen[bytes]:
        popen = subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL)

        def keep() -> None:
            with popen._waitpid_lock:  # type: ignore[attr-defined]
                keeping.set()
                seen_end.wait(_TIMEOUT_S)
            popen.wait()

        threading.Thread(target=keep, daemon=True).start()
        keeping.wait(_TIMEOUT_S)
        return popen

    monkeypatch.setattr(_Process, "died", late_reader)
    monkeypatch.setattr(worker_module, "_spawn", late_keeper)
    with CheckpointManager(tmp_path, runtime=Runtime(executor="process")) as manager:
        try:
            worker = manager._runner.worker
            assert worker is not None
            worker.start()
            os.kill(held_workers[0], signal.SIGCONT)
            first = ready_worker(manager)
            os.kill(first, signal.SIGKILL)
            _wait_exited(first)  # a zombie: nobody has reaped it
            # Its last threads end after the zombie shows: it is not ready once they have.
            deadline = time.monotonic() + _TIMEOUT_S
            while worker.ready:
                assert time.monotonic() < deadline, "a dead worker stayed ready"
                time.sleep(0.01)
            assert worker.pid is None and psutil.pid_exists(first)  # still not reaped
            assert _save(manager, 1) == "step_000000001"  # on a thread, not in the held one
            assert manager.stats().worker_saves == 0
        finally:
            seen_end.set()  # before the close, which waits for the reader


def _wait_exited(pid: int) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"pid {pid} did not exit in {_TIMEOUT_S} s"
        time.sleep(0.01)


def test_the_ranks_save_in_their_workers_only_when_every_ranks_is_ready() -> None:
    ready, starting = Vote("save", 1, worker_ready=True), Vote("save", 1)
    replacing = Vote("save", 1, worker_ready=True, broken=(WORKERS,))
    assert decide([ready, ready], BusyPolicy.WAIT).worker
    assert not decide([ready, starting], BusyPolicy.WAIT).worker
    assert not decide([ready, replacing], BusyPolicy.WAIT).worker  # new workers, not ready
    busy = Vote("save", 1, busy=True, worker_ready=True)
    assert decide([busy, ready], BusyPolicy.WAIT).worker  # kept for the start after the wait
    assert decide([busy, ready], BusyPolicy.COALESCE).worker


def _one_rank_not_ready(rank: int, world_size: int, root: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with CheckpointManager(
        root, bounds=Bounds(deadline_s=20.0), runtime=Runtime(executor="process")
    ) as manager:
        seen["committed"] = [_save(manager, 1)]  # no worker yet on either rank
        seen["worker_saves"] = [manager.stats().worker_saves]
        ready_worker(manager)
        real = SaveWorker.ready
        if rank == 1:  # its worker's "ready" not read yet (as a slow reader thread would be)
            SaveWorker.ready = property(lambda _: False)  # type: ignore[method-assign,assignment]
        try:
            seen["committed"].append(_save(manager, 2))
        finally:
            SaveWorker.ready = real  # type: ignore[method-assign]
        seen["worker_saves"].append(manager.stats().worker_saves)
        seen["committed"].append(_save(manager, 3))
        seen["worker_saves"].append(manager.stats().worker_saves)
        stats = manager.stats()
        seen["sync"] = (stats.sync_saves, stats.fallback_reason, stats.failed)
    return seen


def test_two_ranks_take_the_same_path_for_each_save(tmp_path: Path) -> None:
    # Had rank 0 saved in its worker while rank 1 saved on its thread, each would wait in a
    # different group for a peer that never comes.
    per_rank = run_ranks(_one_rank_not_ready, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, seen in enumerate(per_rank):
        assert seen["committed"] == [f"step_{s:09d}" for s in (1, 2, 3)], (rank, seen)
        assert seen["worker_saves"] == [0, 0, 1], (rank, seen)
        assert seen["sync"] == (0, None, 0), (rank, seen)


def test_close_kills_a_worker_still_starting_without_waiting_for_it(
    tmp_path: Path, held_workers: list[int]
) -> None:

    # Held at birth, it would answer close only once let go: close must not wait on it (its
    # timeout is far beyond the test's own), and nothing of it may outlive the manager.
    manager = CheckpointManager(tmp_path, runtime=Runtime(executor="process"))
    assert _save(manager, 1) == "step_000000001"  # on a thread: the worker is still held
    manager.close(timeout_s=3600)
    assert len(held_workers) == 1
    assert not psutil.pid_exists(held_workers[0]) or (
        psutil.Process(held_workers[0]).status() == psutil.STATUS_ZOMBIE
    )


class _SlowClock:
    """Ten seconds pass between any two readings: every save looks far slower than its
    interval to the fallback's latency trigger."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


@pytest.mark.parametrize(("executor", "falls_back"), [("thread", True), ("process", False)])
def test_the_fallback_never_counts_a_save_made_while_the_worker_starts(
    tmp_path: Path, executor: str, falls_back: bool, held_workers: list[int]
) -> None:
    """Saves on a thread while the worker starts share the host with its imports and carry the
    first save's one-time costs (chaos seed 164 fell back on them): the fallback judges the
    steady state. The same slow completions trip it on the thread executor."""
    fallback = FallbackOptions(latency_window=1, min_completed=1, save_interval_s=1.0)
    with CheckpointManager(
        tmp_path,
        policy=SavePolicy(sync_fallback=fallback),
        runtime=Runtime(executor=executor, clock=_SlowClock()),
    ) as manager:
        for step in (1, 2, 3):
            _save(manager, step)
        assert (manager.stats().fallback_reason is not None) is falls_back
        assert len(held_workers) == (executor == "process")  # held at birth: never ready
