"""``Runtime(executor="process")``: the write, commit and replication run in one
persistent worker process, with every guarantee of the thread executor.

Real saves, a real worker (``python -I dcp_safe/worker/boot.py``), real files; a worker is
killed with a real SIGKILL, from inside its own write (``DiesMidWrite``) or from the test.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
from support import (
    assert_state_equal,
    blank_like,
    checkpoint_workers,
    make_state,
    manifest_parses,
    ready_worker,
)
from support.faults import DamagesAfterCommit, DiesInWriteData, DiesMidWrite
from telemetry._spans import check_nesting, intervals, only, phases
from torch.distributed import TCPStore

from dcp_safe import (
    Bounds,
    BudgetedStager,
    CheckpointCorruptError,
    CheckpointManager,
    CommitError,
    ConfigError,
    MemoryBudget,
    Runtime,
    SavePolicy,
    Topology,
    list_checkpoints,
)
from dcp_safe.coordination.worker_group import WorkerGroup, join, store_address
from dcp_safe.errors import (
    BudgetExceededError,
    DrainTimeoutError,
    SnapshotMutatedError,
    WorkerDiedError,
    WorkerError,
)
from dcp_safe.staging.poison import FailedStaging, poisoned
from dcp_safe.staging.shared import SharedSlabs
from dcp_safe.telemetry import Telemetry
from dcp_safe.testing.staging import hold_staging
from dcp_safe.worker.transport import StateEncoder, decode_error, encode_error, map_slab

pytestmark = pytest.mark.worker_process  # "auto" keeps choosing the worker here

_TIMEOUT_S = 120  # a safety net against a hang, never an assertion


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _committed(root: Path) -> list[str]:
    return [info.name for info in list_checkpoints(root)]


def _worker_pid(manager: CheckpointManager) -> int:
    worker = manager._runner.worker
    assert worker is not None and worker.pid is not None
    return worker.pid


def test_saves_in_one_worker_and_restores_each_step_exactly(tmp_path: Path) -> None:
    shm = _shm()
    with CheckpointManager(tmp_path, keep_last=3, runtime=Runtime(executor="process")) as manager:
        pids = {ready_worker(manager)}
        for step in range(3):
            handle = manager.save(step, make_state(step))
            assert handle is not None
            assert handle.committed.result(_TIMEOUT_S) == f"step_{step:09d}"
            pids.add(_worker_pid(manager))
        assert len(pids) == 1  # started once, reused
        assert checkpoint_workers() == list(pids)
        for step in range(3):
            target = blank_like(make_state(step))
            manager.restore(target, step)
            assert_state_equal(target, make_state(step), f"step {step}")
        assert [e["event"] for e in manager.history()].count("committed") == 3
        assert manager.stats().committed == manager.stats().worker_saves == 3
    assert checkpoint_workers() == []
    assert _shm() == shm


def test_a_tensor_changed_during_the_copy_fails_the_save(tmp_path: Path) -> None:
    state = {"w": torch.zeros(1000), "step": 1}
    returned: list[Any] = []
    with CheckpointManager(tmp_path, runtime=Runtime(executor="process")) as manager:
        with hold_staging(manager.stager):
            saver = threading.Thread(target=lambda: returned.append(manager.save(1, state)))
            saver.start()
            deadline = time.monotonic() + _TIMEOUT_S
            while manager.stager.stats().admitted < 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # save(1) is blocked in its copy
            state["w"].add_(1)
        saver.join(_TIMEOUT_S)
        [handle] = returned
        with pytest.raises(SnapshotMutatedError) as caught:
            handle.committed.result(_TIMEOUT_S)
        assert caught.value.fqns == ("w",)
        assert manager.save(2, state).committed.result(_TIMEOUT_S) == "step_000000002"
        with pytest.raises(SnapshotMutatedError):
            manager.wait()
    assert _committed(tmp_path) == ["step_000000002"]
    assert manager.stager.stats().torn == 1


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_failed_write_reaches_the_handle_as_the_same_error(tmp_path: Path, executor: str) -> None:
    writer = DiesInWriteData(tmp_path)
    with CheckpointManager(tmp_path, runtime=Runtime(writer=writer, executor=executor)) as manager:
        if executor == "process":
            ready_worker(manager)
        handle = manager.save(1, make_state())
        with pytest.raises(CommitError) as caught:
            handle.committed.result(_TIMEOUT_S)
        assert type(caught.value) is CommitError
        assert "Input/output error (injected)" in str(caught.value)
        with pytest.raises(CommitError):
            manager.wait()
        assert manager.stager.stats().in_flight == 0  # the generation was released
    assert _committed(tmp_path) == []


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_budget_holds_as_with_threads(tmp_path: Path, executor: str) -> None:
    budget = MemoryBudget(usable_bytes=256 << 10, reserve_bytes=0)
    with CheckpointManager(
        tmp_path, bounds=Bounds(budget=budget), runtime=Runtime(executor=executor)
    ) as manager:
        with pytest.raises(BudgetExceededError):
            manager.save(1, {"w": torch.zeros(1 << 18)})  # 1 MiB
        handle = manager.save(2, {"w": torch.zeros(1 << 14)})  # 64 KiB
        assert handle is not None and handle.committed.result(_TIMEOUT_S) == "step_000000002"
        assert manager.stager.stats().peak_pool_bytes <= budget.envelope_bytes


def test_a_worker_killed_mid_save_fails_that_save_and_the_next_starts_a_new_one(
    tmp_path: Path,
) -> None:
    shm = _shm()
    writer = DiesMidWrite(str(tmp_path), victim=0, at_step=2)  # SIGKILLs the worker in step 2
    with CheckpointManager(
        tmp_path, keep_last=5, runtime=Runtime(writer=writer, executor="process")
    ) as manager:
        ready_worker(manager)  # on the thread path its SIGKILL would hit this process
        assert manager.save(1, make_state(1)).committed.result(_TIMEOUT_S) == "step_000000001"
        first = _worker_pid(manager)
        handle = manager.save(2, make_state(2))
        with pytest.raises(WorkerDiedError, match=r"killed by signal 9.*next save starts a new"):
            handle.committed.result(_TIMEOUT_S)
        assert not psutil.pid_exists(first)  # reaped before the save failed
        assert manager.stager.stats().in_flight == 0  # the staged generation was released
        assert _committed(tmp_path) == ["step_000000001"]  # nothing of step 2 published
        target = blank_like(make_state(1))
        manager.restore(target)
        assert_state_equal(target, make_state(1))
        assert manager.save(3, make_state(3)).committed.result(_TIMEOUT_S) == "step_000000003"
        assert _worker_pid(manager) != first
        with pytest.raises(WorkerDiedError):
            manager.wait()  # the failure was kept for the caller, once
    assert _committed(tmp_path) == ["step_000000001", "step_000000003"]
    assert checkpoint_workers() == []
    assert _shm() == shm


def test_a_worker_killed_between_saves_is_replaced(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, runtime=Runtime(executor="process")) as manager:
        manager.save(1, make_state(1)).committed.result(_TIMEOUT_S)
        first = _worker_pid(manager)
        os.kill(first, signal.SIGKILL)
        psutil.Process(first).wait(_TIMEOUT_S)
        assert manager.save(2, make_state(2)).committed.result(_TIMEOUT_S) == "step_000000002"
        assert _worker_pid(manager) != first


def test_close_stops_a_hung_worker_within_its_timeout(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, runtime=Runtime(executor="process"))
    manager.save(1, make_state(1)).committed.result(_TIMEOUT_S)
    worker = _worker_pid(manager)
    os.kill(worker, signal.SIGSTOP)  # it will never answer "close"
    with contextlib.suppress(DrainTimeoutError):  # a loaded host: the rest goes on behind
        manager.close(timeout_s=5)
    deadline = time.monotonic() + _TIMEOUT_S
    while psutil.pid_exists(worker) and time.monotonic() < deadline:
        time.sleep(0.05)  # killed once the close's bound has passed, then reaped
    assert not psutil.pid_exists(worker)
    assert checkpoint_workers() == []


def test_replication_runs_in_the_worker(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(
        Topology.of(local, replicate_to=remote), runtime=Runtime(executor="process")
    ) as manager:
        ready_worker(manager)
        handle = manager.save(1, make_state(1))
        handle.committed.result(_TIMEOUT_S)
        handle.replicated.result(_TIMEOUT_S)
        assert manager.latest("remote") == "step_000000001"
    assert _committed(remote) == ["step_000000001"]


def test_the_workers_phase_spans_reach_the_parents_telemetry(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with Telemetry(sample_memory=False) as tel:
        with CheckpointManager(
            Topology.of(local, replicate_to=remote),
            runtime=Runtime(executor="process", telemetry=tel),
        ) as manager:
            ready_worker(manager)
            handle = manager.save(4, make_state(4))
            handle.committed.result(_TIMEOUT_S)
            handle.replicated.result(_TIMEOUT_S)
        spans = intervals(tel.memory.events())
    check_nesting(spans)
    name = handle.name
    assert phases(spans, name)[:5] == ["save", "staging", "plan", "write", "commit"]
    assert sorted(phases(spans, name)[5:]) == ["release", "replication"]
    save, plan, write, commit = (only(spans, p) for p in ("save", "plan", "write", "commit"))
    assert {plan.parent, write.parent, commit.parent} == {save.id}  # the worker's root is not
    assert plan.end <= write.start and write.end <= commit.start
    assert write.bytes is not None and write.bytes > 0 and commit.bytes == write.bytes
    replication = only(spans, "replication")
    assert replication.parent is None and replication.ok and replication.start >= commit.end
    # The replica's manifest bytes (as with threads), from the header the worker sent back.
    replica = handle.replicated.result(0)
    assert (replica.name, replica.step) == (name, 4)
    assert replication.bytes == replica.total_bytes > 0
    assert all(s.ok for s in spans)


def test_a_failure_to_record_the_workers_spans_never_fails_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(Telemetry):
        def adopt(self, events: Any, parent: Any) -> int:
            raise RuntimeError("a sink broke (test)")

    with (
        Broken(sample_memory=False) as tel,
        CheckpointManager(tmp_path, runtime=Runtime(executor="process", telemetry=tel)) as manager,
    ):
        ready_worker(manager)
        handle = manager.save(1, make_state(1))
        assert handle.committed.result(_TIMEOUT_S) == "step_000000001"
        assert manager.save(2, make_state(2)).committed.result(_TIMEOUT_S) == "step_000000002"
    assert "recording the worker's spans of step_000000001 failed" in caplog.text


def test_a_failed_write_in_the_worker_fails_its_span_and_its_replication(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    writer = DiesInWriteData(local, replicate_to=remote)
    with Telemetry(sample_memory=False) as tel:
        manager = CheckpointManager(
            local, runtime=Runtime(writer=writer, executor="process", telemetry=tel)
        )
        ready_worker(manager)
        handle = manager.save(1, make_state())
        with pytest.raises(CommitError, match="injected"):
            handle.committed.result(_TIMEOUT_S)
        worker = manager._runner.worker
        assert worker is not None
        replication = worker.replication(handle.name)  # resolved, not left pending
        assert replication.done() and isinstance(replication.exception(), CommitError)
        with pytest.raises(CommitError):
            manager.close(_TIMEOUT_S)
        spans = intervals(tel.memory.events())
    check_nesting(spans)
    assert phases(spans, handle.name) == ["save", "staging", "plan", "write", "release"]
    assert not only(spans, "write").ok and not only(spans, "save").ok
    errors = [e.error for e in tel.memory.events() if e.name == "write" and e.error]
    assert errors and "Input/output error (injected)" in errors[0]


@pytest.mark.parametrize(("validate", "part"), [("manifest", "manifest"), ("deep", "shard")])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_checkpoint_damaged_after_its_commit_fails_its_check_and_prunes_nothing(
    tmp_path: Path, executor: str, validate: str, part: str
) -> None:
    writer = DamagesAfterCommit(str(tmp_path), at_step=3, part=part)
    with CheckpointManager(
        tmp_path,
        keep_last=1,
        policy=SavePolicy(validate=validate),
        runtime=Runtime(writer=writer, executor=executor),
    ) as manager:
        if executor == "process":
            ready_worker(manager)
        for step in (1, 2):
            manager.save(step, make_state(step)).committed.result(_TIMEOUT_S)
        kept, pruned = _committed(tmp_path), manager.stats().pruned
        bad = manager.save(3, make_state(3))
        with pytest.raises(CheckpointCorruptError):
            bad.committed.result(_TIMEOUT_S)
        with pytest.raises(CheckpointCorruptError):
            manager.wait(_TIMEOUT_S)
        assert manager.stats().failed == 1
        # Not trusted: nothing was pruned behind it (a damaged manifest is not even listed).
        assert manager.stats().pruned == pruned
        assert [n for n in _committed(tmp_path) if n != bad.name] == kept
        manager.save(4, make_state(4)).committed.result(_TIMEOUT_S)
    assert _committed(tmp_path)[-1] == "step_000000004"
    assert bad.name not in _committed(tmp_path)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_worker_checks_each_commit_so_training_parses_no_manifest(
    tmp_path: Path, executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A manifest parse is Python on a thread of the training process (~0.3 s at 10,000
    # items); with the process executor the worker checks each commit and hands back its
    # header, which retention lists by.
    parsed = manifest_parses(monkeypatch)
    with CheckpointManager(tmp_path, keep_last=2, runtime=Runtime(executor=executor)) as manager:
        if executor == "process":
            ready_worker(manager)
        for step in range(1, 5):
            handle = manager.save(step, make_state(step))
            assert handle.committed.result(_TIMEOUT_S) == f"step_{step:09d}"
        assert manager.stats().pruned == 2
    assert _committed(tmp_path) == ["step_000000003", "step_000000004"]
    if executor == "process":
        assert parsed == []
    else:  # the same saves in one process parse each new manifest once
        assert len(parsed) == 4


_PARENT = """
import os, signal, sys, torch
from dcp_safe import CheckpointManager, Runtime

manager = CheckpointManager(sys.argv[1], runtime=Runtime(executor="process"))
manager.save(1, {"w": torch.ones(4096)}).committed.result(120)
print(manager._runner.worker.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_parent_leaves_no_worker_and_no_shared_memory(tmp_path: Path) -> None:
    shm = _shm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-c", _PARENT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    worker = int(done.stdout.split()[-1])
    deadline = time.monotonic() + _TIMEOUT_S
    while psutil.pid_exists(worker) and time.monotonic() < deadline:
        time.sleep(0.05)  # it notices its parent is gone
    assert not psutil.pid_exists(worker)
    assert _shm() == shm
    assert _committed(tmp_path) == ["step_000000001"]


def test_what_the_process_executor_refuses(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'auto', 'thread', 'process'"):
        CheckpointManager(tmp_path, runtime=Runtime(executor="fork"))
    with pytest.raises(ConfigError, match="shared_memory=True"):
        CheckpointManager(tmp_path, runtime=Runtime(executor="process", stager=BudgetedStager()))


def test_the_state_crosses_by_place_and_errors_by_value() -> None:
    slabs = SharedSlabs()
    base = slabs.allocate(6 * 6 * 4)
    square = base.view(torch.float32).view(6, 6)
    square.copy_(torch.randn(6, 6))
    state = {"t": square.t(), "rows": square[2:5], "private": torch.ones(3), "n": 1}
    encoder = StateEncoder(slabs)
    data = encoder.dump(state)
    assert encoder.dump(state) == data  # the second time from what it remembers
    assert len(data) < 1000  # places, not bytes (the private tensor is small)
    for slab, (fd, size) in slabs.slabs().items():
        map_slab(slab, fd, size)  # as the worker does
    rebuilt = pickle.loads(data)
    assert_state_equal(rebuilt, state)
    assert rebuilt["t"].stride() == (1, 6)

    class Local(Exception):  # not importable: cannot be unpickled
        pass

    try:
        raise Local("boom")
    except Local as exc:
        error = decode_error(encode_error(exc))
    assert isinstance(error, WorkerError) and error.type_name == "Local"
    assert "boom" in str(error) and "Traceback" in error.worker_traceback
    typed = decode_error(encode_error(SnapshotMutatedError(["w"])))
    assert isinstance(typed, SnapshotMutatedError) and typed.fqns == ("w",)
    assert "in the checkpoint worker" in typed.__notes__[0]
    # A rank's refused staging crosses as its error: the worker's planning raises it.
    refused = pickle.loads(encoder.dump(poisoned(SnapshotMutatedError(["w"], rank=1))))
    [failed] = refused.values()
    assert isinstance(failed, FailedStaging) and isinstance(failed.error, SnapshotMutatedError)
    assert failed.error.fqns == ("w",) and failed.error.rank == 1
    slabs.close()


def test_a_worker_whose_peers_never_join_fails_within_the_deadline_naming_them() -> None:
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30))
    group = WorkerGroup(
        host="127.0.0.1",
        port=store.port,
        prefix="t/0/",
        rank=0,
        world_size=3,
        timeout_s=1.0,
        generation=0,
    )
    with pytest.raises(CommitError, match="could not form their group") as caught:
        join(group)  # ranks 1 and 2 never start a worker
    assert sorted(caught.value.failures) == [1, 2]
    assert not dist.is_initialized()


def test_several_ranks_need_a_store_their_workers_can_reach(tmp_path: Path) -> None:
    # Several ranks are tested in test_process_executor_multirank.py; a job whose default group
    # rendezvoused through a file has no address to give its workers.
    with pytest.raises(ConfigError, match="TCPStore"):
        store_address(dist.FileStore(str(tmp_path / "store"), 1))
