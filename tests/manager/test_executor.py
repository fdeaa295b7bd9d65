"""Which executor a manager saves with: ``"auto"`` (the default) takes the worker process where
every one of its needs holds, and a thread otherwise, saying why; ``"process"`` insists.

Real managers, real saves and worker processes, a real two-rank group rendezvoused through a
file.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from support import assert_state_equal, blank_like, checkpoint_workers, make_state

from dcp_safe import (
    Bounds,
    BudgetedStager,
    CheckpointManager,
    ConfigError,
    Runtime,
    SafeStorageWriter,
    Topology,
    list_checkpoints,
)
from dcp_safe.testing.multiproc import run_ranks

pytestmark = pytest.mark.worker_process  # "auto" keeps choosing the worker here

_TIMEOUT_S = 120  # a safety net against a hang, never an assertion


class _LockedWriter(SafeStorageWriter):
    """A writer holding a lock: it cannot be pickled to a worker."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.lock = threading.Lock()


def test_by_default_saves_run_in_a_worker_process_and_restore_exactly(tmp_path: Path) -> None:
    before = checkpoint_workers()
    with CheckpointManager(tmp_path) as manager:
        assert manager.executor == "process"
        assert checkpoint_workers() == before  # started by the first save, not by the manager
        handle = manager.save(1, make_state(1))
        assert handle is not None
        assert handle.committed.result(_TIMEOUT_S) == "step_000000001"
        assert len(checkpoint_workers()) == len(before) + 1
    assert checkpoint_workers() == before  # closed with the manager
    with CheckpointManager(tmp_path) as manager:
        target = blank_like(make_state(1))
        assert manager.restore(target).name == "step_000000001"
        assert_state_equal(target, make_state(1))
        assert checkpoint_workers() == before  # a manager that only restores starts no worker


def test_a_writer_of_the_callers_stays_on_a_thread_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Its copy in a worker would not touch this process's objects: a silent change of behaviour.
    with caplog.at_level(logging.INFO, logger="dcp_safe.manager"):
        manager = CheckpointManager(tmp_path, runtime=Runtime(writer=SafeStorageWriter(tmp_path)))
    with manager:
        assert manager.executor == "thread"
        assert "executor='auto' chose 'thread'" in caplog.text
        assert "the writer is the caller's" in caplog.text
        assert manager.save(1, make_state(1)).committed.result(_TIMEOUT_S) == "step_000000001"
        assert manager._runner.worker is None
    # Asked for, the process takes the caller's writer (a copy of it).
    with CheckpointManager(
        tmp_path, runtime=Runtime(writer=SafeStorageWriter(tmp_path), executor="process")
    ) as m:
        assert m.executor == "process"


def test_a_root_in_one_processs_memory_stays_on_a_thread(tmp_path: Path, memory_root: str) -> None:
    with CheckpointManager(Topology.of(tmp_path, replicate_to=memory_root)) as manager:
        assert manager.executor == "thread"
        handle = manager.save(1, make_state(1))
        assert handle is not None
        handle.replicated.result(_TIMEOUT_S)
    assert [c.name for c in list_checkpoints(memory_root)] == ["step_000000001"]
    with pytest.raises(ConfigError, match="one process's memory"):
        CheckpointManager(memory_root, runtime=Runtime(executor="process"))


def test_a_stager_that_shares_no_memory_stays_on_a_thread(tmp_path: Path) -> None:
    with BudgetedStager() as stager:
        with CheckpointManager(tmp_path, runtime=Runtime(stager=stager)) as manager:
            assert manager.executor == "thread"
        with pytest.raises(ConfigError, match="shared_memory=True"):
            CheckpointManager(tmp_path, runtime=Runtime(stager=stager, executor="process"))
    with (
        BudgetedStager(shared_memory=True) as shared,
        CheckpointManager(tmp_path, runtime=Runtime(stager=shared)) as manager,
    ):
        assert manager.executor == "process"


def test_without_memfd_the_process_cannot_share_its_slabs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "memfd_create")  # as on macOS
    with CheckpointManager(tmp_path) as manager:
        assert manager.executor == "thread"
        assert manager.save(1, make_state(1)).committed.result(_TIMEOUT_S) == "step_000000001"
    with pytest.raises(ConfigError, match="memfd_create"):
        CheckpointManager(tmp_path, runtime=Runtime(executor="process"))


def test_a_writer_that_does_not_pickle_is_refused_by_the_process_before_any_save(
    tmp_path: Path,
) -> None:

    with pytest.raises(ConfigError, match="_LockedWriter does not pickle"):
        CheckpointManager(
            tmp_path, runtime=Runtime(writer=_LockedWriter(tmp_path), executor="process")
        )
    with CheckpointManager(tmp_path, runtime=Runtime(writer=_LockedWriter(tmp_path))) as manager:
        assert manager.executor == "thread"


def test_unknown_executors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'auto', 'thread', 'process'"):
        CheckpointManager(tmp_path, runtime=Runtime(executor="fork"))


def _behind_a_file_store(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # A job whose group rendezvoused through a file gives its workers no address to meet at.
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(root, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    with CheckpointManager(os.path.join(root, "ckpt"), bounds=Bounds(deadline_s=20.0)) as manager:
        chosen = manager.executor
    refused = ""
    try:
        CheckpointManager(os.path.join(root, "ckpt"), runtime=Runtime(executor="process"))
    except ConfigError as exc:
        refused = str(exc)
    return {"chosen": chosen, "refused": refused}


def test_several_ranks_behind_a_file_store_save_on_threads(tmp_path: Path) -> None:
    for result in run_ranks(_behind_a_file_store, 2, args=(str(tmp_path),)):
        assert result["chosen"] == "thread"
        assert "TCPStore" in result["refused"]
