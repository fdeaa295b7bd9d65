"""The checkpoint worker's life: it knows its parent before any import and never acts for a
dead rank, imports nothing from the working directory, is killed when it stops making
progress, dies with ``close()`` whatever it was doing, and takes its rank's file size limit
with each save.

Real managers (``executor="process"``), real workers, real signals; a rank that dies is a
subprocess killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from support import checkpoint_workers, make_state, ready_worker
from support.faults import DiesMidWrite, StopsInWorker

from dcp_safe import Bounds, CheckpointManager, CommitError, Runtime, list_checkpoints
from dcp_safe.errors import DrainTimeoutError, WorkerDiedError
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.worker import parent as worker_module

pytestmark = pytest.mark.worker_process  # "auto" keeps choosing the worker here

_TIMEOUT_S = 120  # a safety net against a hang, never an assertion
_DEADLINE_S = 10.0  # with several ranks, the bound of a worker's silence


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=_TIMEOUT_S,
    )


def test_a_module_planted_in_the_working_directory_never_runs_in_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    planted = f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted')\n"
    root = tmp_path / "root"
    root.mkdir()
    (root / "psutil.py").write_text(planted, encoding="utf-8")  # the worker imports psutil
    monkeypatch.chdir(root)
    with CheckpointManager(
        ".", runtime=Runtime(executor="process")
    ) as manager:  # the red team's call
        ready_worker(manager)
        handle = manager.save(1, make_state(1))
        assert handle is not None and handle.committed.result(_TIMEOUT_S) == "step_000000001"
    assert not marker.exists()


_DIES_WHILE_ITS_WORKER_STARTS = """
import os, signal, sys
from concurrent.futures import Future
import torch
from dcp_safe import CheckpointManager, Runtime
manager = CheckpointManager(sys.argv[1], runtime=Runtime(executor="process"))
worker = manager._runner.worker
staged = Future()
staged.set_result({"w": torch.ones(4096)})
worker.submit("step_000000001", 1, staged)  # a save handed to the worker, as it starts
worker._sender.submit(lambda: None).result()  # sent: it waits in the worker's socket
assert not worker._process.ready.done(), "the worker started before the rank died"
print(worker._process.popen.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_whose_rank_dies_while_it_starts_dies_and_commits_nothing(
    tmp_path: Path,
) -> None:
    done = _run(_DIES_WHILE_ITS_WORKER_STARTS, str(tmp_path))
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (
        "dcp_safe/worker/main.py" not in done.stderr
    )  # killed with its rank: it ran nothing after
    worker = int(done.stdout.split()[-1])
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(worker).wait(_TIMEOUT_S)  # not its parent's: its reaper's
    assert _gone(worker)
    assert list_checkpoints(tmp_path) == []
    assert not list(tmp_path.rglob("_COMMITTED"))  # nor a commit of that save anywhere


def test_a_worker_killed_as_it_appears_is_a_death_not_an_error_of_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed before its parent could hand it the writer (chaos seed 162), the worker is one
    that died: the request that started it saves on a thread, never a ``BrokenPipeError`` on
    the training thread, and the next start brings up a worker that saves."""
    real_spawn = worker_module._spawn
    killed: list[int] = []

    def spawn_then_kill(command: list[str], fd: int) -> Any:
        popen = real_spawn(command, fd)
        if not killed:
            popen.kill()
            popen.wait()
            killed.append(popen.pid)
        return popen

    monkeypatch.setattr(worker_module, "_spawn", spawn_then_kill)
    state = make_state(0)
    with CheckpointManager(tmp_path, runtime=Runtime(executor="process")) as manager:
        handle = manager.save(1, state)
        assert handle is not None and killed
        assert handle.committed.result(timeout=_TIMEOUT_S) == "step_000000001"
        assert ready_worker(manager) not in killed
        manager.save(2, state)
        manager.wait()
    assert manager.stats().worker_saves == 1
    assert [c.name for c in list_checkpoints(tmp_path)][-1] == "step_000000002"


def test_a_stopped_worker_fails_its_save_and_the_next_save_succeeds(tmp_path: Path) -> None:
    writer = StopsInWorker(str(tmp_path), at_step=2)
    # The worker's bound of silence follows the manager's deadlines: here 5 s, its least.
    with CheckpointManager(
        tmp_path,
        bounds=Bounds(wait_timeout_s=5),
        runtime=Runtime(writer=writer, executor="process"),
    ) as manager:
        first = ready_worker(manager)
        assert manager.save(1, make_state(1)).committed.result(_TIMEOUT_S) == "step_000000001"
        handle = manager.save(2, make_state(2))
        with pytest.raises(WorkerDiedError, match=r"sent nothing for 5 s .*stopped"):
            handle.committed.result(_TIMEOUT_S)
        assert _gone(first)
        assert manager.save(3, make_state(3)).committed.result(_TIMEOUT_S) == "step_000000003"
        with pytest.raises(WorkerDiedError):
            manager.wait()  # the failure was kept for the caller, once
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000000001", "step_000000003"]
    assert checkpoint_workers() == []


def test_close_kills_a_worker_stopped_mid_save(tmp_path: Path) -> None:
    writer = StopsInWorker(str(tmp_path), at_step=1)
    manager = CheckpointManager(tmp_path, runtime=Runtime(writer=writer, executor="process"))
    pid = ready_worker(manager)
    handle = manager.save(1, make_state(1))
    assert handle is not None
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert not handle.committed.done(), "the save ended before its worker stopped"
        time.sleep(0.01)
    with contextlib.suppress(DrainTimeoutError, WorkerDiedError):
        manager.close(timeout_s=2)
    assert _gone(pid)
    assert checkpoint_workers() == []
    with pytest.raises((WorkerDiedError, DrainTimeoutError)):  # killed, or abandoned first
        handle.committed.result(_TIMEOUT_S)


_FILE_SIZE_LIMIT = """
import resource, sys
import torch
from support import ready_worker
from dcp_safe import CheckpointManager, Runtime
manager = CheckpointManager(sys.argv[1], runtime=Runtime(executor=sys.argv[2]))
pid = ready_worker(manager) if sys.argv[2] == "process" else None
state = {"w": torch.ones(1 << 18)}  # 1 MiB, past the limit
manager.save(0, state).committed.result(120)  # its staging slabs exist before the limit
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
try:
    manager.save(1, state).committed.result(120)
    print("committed")
except Exception as exc:
    chain = [exc, *([exc.__cause__] if exc.__cause__ else [])]
    print("failed", type(exc).__name__, any("File too large" in str(e) for e in chain))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print(manager.save(2, state).committed.result(120))
print("same worker", pid == (manager._runner.worker.pid if pid else None))
try:
    manager.close()
except Exception as exc:  # the failure kept for the caller
    print("close", type(exc).__name__)
"""


def test_the_worker_takes_its_ranks_file_size_limit_with_each_save(tmp_path: Path) -> None:
    outcomes = {}
    for executor in ("thread", "process"):
        done = _run(_FILE_SIZE_LIMIT, str(tmp_path / executor), executor)
        assert done.returncode == 0, done.stderr
        outcomes[executor] = done.stdout.splitlines()
    failed, *then = outcomes["process"]
    assert failed.startswith("failed ") and failed.endswith(" True"), outcomes
    assert failed == outcomes["thread"][0]  # the same error as the thread executor's
    assert then == ["step_000000002", "same worker True", f"close {failed.split()[1]}"]


def _rank_1s_worker_stops_mid_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    writer = DiesMidWrite(root, victim=1, signum=signal.SIGSTOP, at_step=2)
    seen: dict[str, Any] = {"error": None}
    with CheckpointManager(
        root,
        keep_last=5,
        bounds=Bounds(deadline_s=_DEADLINE_S),
        runtime=Runtime(writer=writer, executor="process"),
    ) as manager:
        ready_worker(manager)  # on the thread path its SIGSTOP would stop the rank
        manager.save(1, make_state(1)).committed.result(_TIMEOUT_S)
        try:
            manager.save(2, make_state(2)).committed.result(_TIMEOUT_S)
        except CommitError as exc:
            seen.update(error=type(exc).__name__, failures=sorted(exc.failures), text=str(exc))
        manager.save(3, make_state(3)).committed.result(_TIMEOUT_S)  # the job saves again
        with contextlib.suppress(CommitError):
            manager.wait()  # the failure kept for the caller
    seen["after_close"] = checkpoint_workers()
    seen["committed"] = [c.name for c in list_checkpoints(root)]
    return seen


@pytest.mark.multiproc
def test_one_ranks_stopped_worker_fails_the_save_on_every_rank_and_the_job_saves_again(
    tmp_path: Path,
) -> None:

    rank0, rank1 = run_ranks(_rank_1s_worker_stops_mid_save, 2, args=(str(tmp_path),))
    assert rank1["error"] == "WorkerDiedError" and rank1["failures"] == [1], rank1
    assert "sent nothing" in rank1["text"], rank1
    assert rank0["error"] == "CommitError" and rank0["failures"] == [1], rank0  # names rank 1
    for seen in (rank0, rank1):
        assert seen["committed"] == ["step_000000001", "step_000000003"], seen
        assert seen["after_close"] == [], seen
