"""CheckpointManager: admission policies, history, retention and draining, with real DCP saves.

Slow storage is a writer whose uploads wait on an Event the test sets: every interleaving is
forced, nothing depends on timing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import Bounds, Retention, Runtime, SavePolicy, Topology, WriterOptions, layout
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.errors import (
    AdmissionTimeoutError,
    CheckpointCorruptError,
    ConfigError,
    DrainTimeoutError,
    StorageError,
)
from dcp_safe.manager import HISTORY_FILE, CheckpointManager
from dcp_safe.staging import BudgetedStager, MemoryBudget
from dcp_safe.topology import Root

_GATE_TIMEOUT_S = 120  # a safety net against a hang, never an assertion


class _SlowWriter(SafeStorageWriter):
    """Background uploads wait for ``gate``; named saves fail or get corrupted after commit."""

    def __init__(
        self,
        root: Any,
        *,
        gate: threading.Event | None = None,
        fail: set[str] | None = None,
        corrupt: set[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(root, **kwargs)
        self.gate = gate
        self.fail = fail or set()
        self.corrupt = corrupt or set()

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.gate is not None and threading.current_thread() is not threading.main_thread():
            assert self.gate.wait(_GATE_TIMEOUT_S)
        if self.checkpoint_id in self.fail:
            raise StorageError("write", str(self.checkpoint_id), "injected failure")
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        name = self.checkpoint_id
        if name in self.corrupt:
            shard = Path(self.root) / str(name) / layout.shard_file_name(0, 0)
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))


def _name(step: int) -> str:
    return f"step_{step:09d}"


def _manager(
    root: Path | Topology,
    writer: SafeStorageWriter | None = None,
    *,
    when_busy: str | None = None,
    save_every: int | None = None,
    keep_last: int | None = None,
    policy: SavePolicy | None = None,
    retention: Retention | None = None,
) -> CheckpointManager:
    """A manager on ``writer`` (default: an ungated ``_SlowWriter``; a topology root comes
    with the writer built for it) and a 1 GiB budget."""
    if writer is None:
        assert isinstance(root, Path)
        writer = _SlowWriter(root)
    budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0)
    return CheckpointManager(
        root,
        when_busy=when_busy,
        save_every=save_every,
        keep_last=keep_last,
        policy=policy,
        retention=retention,
        bounds=Bounds(budget=budget),
        runtime=Runtime(writer=writer),
    )


def _names(root: Path) -> list[str]:
    return sorted(info.name for info in dcp_safe.list_checkpoints(root))


def _events(root: Path, event: str, tier: str = "local") -> list[int]:
    lines = (root / HISTORY_FILE).read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines) if e["event"] == event and e["tier"] == tier]


def _release_when_waiting(manager: CheckpointManager, gate: threading.Event) -> threading.Thread:
    def release() -> None:
        while manager.stats().waiting == 0:
            time.sleep(0.001)
        gate.set()

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def test_skip_returns_none_counts_and_records_it(tmp_path: Path) -> None:
    gate = threading.Event()
    with _manager(tmp_path, _SlowWriter(tmp_path, gate=gate), when_busy="skip") as manager:
        first = manager.save(1, make_state(1))
        assert first is not None
        assert manager.save(2, make_state(2)) is None
        assert manager.stats().skipped == 1
        gate.set()
        assert first.committed.result(_GATE_TIMEOUT_S) == _name(1)
    assert _names(tmp_path) == [_name(1)]
    assert _events(tmp_path, "skipped") == [2]
    assert _events(tmp_path, "requested") == [1, 2]


def test_wait_blocks_until_the_save_in_flight_is_done_and_both_commit(tmp_path: Path) -> None:
    gate = threading.Event()
    with _manager(tmp_path, _SlowWriter(tmp_path, gate=gate), when_busy="wait") as manager:
        first = manager.save(1, make_state(1))
        releaser = _release_when_waiting(manager, gate)
        second = manager.save(2, make_state(2))
        releaser.join()
        assert first is not None and first.committed.done()  # it waited for the whole save
        assert second is not None and second.committed.result(_GATE_TIMEOUT_S) == _name(2)
        stats = manager.stats()
        assert stats.waited_s > 0 and stats.skipped == 0 and stats.committed == 2
        assert manager.latest() == _name(2)
    assert _names(tmp_path) == [_name(1), _name(2)]


def test_coalesce_saves_only_the_newest_request_as_it_was_when_requested(tmp_path: Path) -> None:
    gate = threading.Event()
    state = make_state(0)
    with _manager(tmp_path, _SlowWriter(tmp_path, gate=gate), when_busy="coalesce") as manager:
        first = manager.save(1, state)
        assert first is not None
        first.staged.result(_GATE_TIMEOUT_S)
        handles = []
        for step in (2, 3, 4):
            state["f32"].fill_(float(step))
            handles.append(manager.save(step, state))
        state["f32"].fill_(99.0)  # after the request: must not reach the checkpoint
        assert all(h is not None for h in handles)
        assert [h.committed.cancelled() for h in handles if h] == [True, True, False]
        gate.set()
        newest = handles[-1]
        assert newest is not None and newest.committed.result(_GATE_TIMEOUT_S) == _name(4)
        manager.wait(_GATE_TIMEOUT_S)
        stats = manager.stats()
        assert (stats.coalesced, stats.skipped, stats.committed) == (3, 2, 2)
        restored = blank_like(state)
        assert manager.restore(restored) == _name(4)
        assert torch.equal(restored["f32"], torch.full_like(state["f32"], 4.0))
    assert _names(tmp_path) == [_name(1), _name(4)]
    assert _events(tmp_path, "skipped") == [2, 3]


def test_sync_saves_in_the_foreground_while_a_save_is_in_flight(tmp_path: Path) -> None:
    gate = threading.Event()
    with _manager(tmp_path, _SlowWriter(tmp_path, gate=gate), when_busy="sync") as manager:
        first = manager.save(1, make_state(1))
        second = manager.save(2, make_state(2))
        assert first is not None and not first.committed.done()
        assert second is not None and second.committed.result(0) == _name(2)
        assert _names(tmp_path) == [_name(2)]
        gate.set()
        assert first.committed.result(_GATE_TIMEOUT_S) == _name(1)
    assert _names(tmp_path) == [_name(1), _name(2)]


def test_raise_refuses_a_save_while_one_is_in_flight(tmp_path: Path) -> None:
    gate = threading.Event()
    with _manager(tmp_path, _SlowWriter(tmp_path, gate=gate), when_busy="raise") as manager:
        assert manager.save(1, make_state(1)) is not None
        with pytest.raises(AdmissionTimeoutError, match="in flight"):
            manager.save(2, make_state(2))
        gate.set()
    assert _names(tmp_path) == [_name(1)]


def test_force_waits_whatever_the_policy(tmp_path: Path) -> None:
    gate = threading.Event()
    with _manager(tmp_path, _SlowWriter(tmp_path, gate=gate), when_busy="skip") as manager:
        manager.save(1, make_state(1))
        releaser = _release_when_waiting(manager, gate)
        assert manager.save(2, make_state(2), force=True) is not None
        releaser.join()
    assert _names(tmp_path) == [_name(1), _name(2)]


def test_history_records_requested_committed_and_a_failed_save(tmp_path: Path) -> None:
    writer = _SlowWriter(tmp_path, fail={_name(2)})
    manager = _manager(tmp_path, writer)
    handles = [manager.save(step, make_state(step)) for step in (1, 2, 3)]
    with pytest.raises(StorageError, match="injected failure"):
        manager.close(_GATE_TIMEOUT_S)
    assert handles[1] is not None
    assert isinstance(handles[1].committed.exception(0), StorageError)
    assert _events(tmp_path, "requested") == [1, 2, 3]
    assert _events(tmp_path, "committed") == [1, 3]
    assert _events(tmp_path, "failed") == [2]
    assert manager.stats().failed == 1
    manager.close()  # idempotent, and the error is not raised twice


def test_retention_keeps_last_two_and_every_fifth(tmp_path: Path) -> None:
    with _manager(tmp_path, keep_last=2, retention=Retention(keep_every=5)) as manager:
        for step in range(1, 11):
            manager.maybe_save(step, make_state(step))
    assert _names(tmp_path) == [_name(5), _name(9), _name(10)]
    assert sorted(_events(tmp_path, "pruned")) == [1, 2, 3, 4, 6, 7, 8]


def test_maybe_save_saves_only_every_nth_step(tmp_path: Path) -> None:
    with _manager(tmp_path, save_every=3, keep_last=10) as manager:
        handles = [manager.maybe_save(step, make_state(step)) for step in range(1, 8)]
    assert [h is not None for h in handles] == [False, False, True, False, False, True, False]
    assert _names(tmp_path) == [_name(3), _name(6)]


def test_no_pruning_when_the_newest_checkpoint_fails_deep_verification(tmp_path: Path) -> None:
    writer = _SlowWriter(tmp_path, corrupt={_name(4)})
    manager = _manager(tmp_path, writer, keep_last=1, policy=SavePolicy(validate="deep"))
    for step in (1, 2, 3):
        manager.save(step, make_state(step))
    manager.wait(_GATE_TIMEOUT_S)
    assert _names(tmp_path) == [_name(2), _name(3)]  # the two newest validated
    pruned_before = _events(tmp_path, "pruned")
    bad = manager.save(4, make_state(4))
    assert bad is not None
    with pytest.raises(CheckpointCorruptError):
        bad.committed.result(_GATE_TIMEOUT_S)
    with pytest.raises(CheckpointCorruptError):
        manager.wait(_GATE_TIMEOUT_S)
    assert _names(tmp_path) == [_name(2), _name(3), _name(4)]
    assert _events(tmp_path, "pruned") == pruned_before == [1]
    assert _events(tmp_path, "failed") == [4]
    manager.save(5, make_state(5))  # a good one again: the corrupt one may go now
    manager.close(_GATE_TIMEOUT_S)
    assert _names(tmp_path) == [_name(3), _name(5)]


def test_close_drains_in_flight_work_and_raises_the_first_background_error(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    writer = _SlowWriter(tmp_path, gate=gate, fail={_name(1)})
    manager = _manager(tmp_path, writer, when_busy="coalesce")
    first = manager.save(1, make_state(1))
    pending = manager.save(2, make_state(2))
    gate.set()
    with pytest.raises(StorageError, match="injected failure"):
        manager.close(_GATE_TIMEOUT_S)
    assert first is not None and first.committed.done()
    assert pending is not None and pending.committed.result(0) == _name(2)  # drained too
    manager.close()
    with pytest.raises(ConfigError, match="closed"):
        manager.save(3, make_state(3))


def test_restore_falls_back_to_the_replica(tmp_path: Path, memory_root: str) -> None:
    local = tmp_path / "local"
    state = make_state(7)
    writer = _SlowWriter(local, replicate_to=memory_root)
    with _manager(Topology.of(local, replicate_to=memory_root), writer) as manager:
        handle = manager.save(7, state)
        assert handle is not None
        handle.replicated.result(_GATE_TIMEOUT_S)
        manager.wait(_GATE_TIMEOUT_S)
        assert manager.latest("remote") == _name(7)
        writer.backend.remove_tree(_name(7))
        restored = blank_like(state)
        assert manager.restore(restored, step=7) == _name(7)
        assert_state_equal(restored, state)
    assert _events(local, "committed", tier="remote") == [7]


def test_a_user_stager_is_used_and_left_open(tmp_path: Path) -> None:
    stager = BudgetedStager(MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0))
    with CheckpointManager(tmp_path, runtime=Runtime(stager=stager)) as manager:
        manager.save(1, make_state(1))
        manager.save(2, make_state(2))
    assert stager.stats().admitted == 2
    assert stager.stats().last_allocated_bytes == 0  # the second save reused the buffers
    stager.close()


def test_bad_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, when_busy="queue")
    with pytest.raises(ConfigError):
        SavePolicy(validate="paranoid")
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, save_every=0)
    with pytest.raises(ConfigError):
        SavePolicy(name_format="../{step}")


def test_coalesce_skips_a_request_when_the_budget_has_no_room_for_its_copy(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    state = {"w": torch.zeros(256, 1024)}  # 1 MiB
    stager = BudgetedStager(MemoryBudget(usable_bytes=3 << 19, reserve_bytes=0))  # 1.5 MiB
    writer = _SlowWriter(tmp_path, gate=gate)
    manager = CheckpointManager(
        tmp_path, when_busy="coalesce", runtime=Runtime(writer=writer, stager=stager)
    )
    with manager:
        first = manager.save(1, state)
        assert first is not None
        first.staged.result(_GATE_TIMEOUT_S)
        assert manager.save(2, state) is None  # the pool holds 1 MiB: no room for a 2nd copy
        assert (manager.stats().skipped, manager.stats().coalesced) == (1, 0)
        gate.set()
    stager.close()
    assert _names(tmp_path) == [_name(1)]
    reasons = [
        json.loads(line).get("reason", "")
        for line in (tmp_path / HISTORY_FILE).read_text().splitlines()
    ]
    assert any("no memory for a pending copy" in r for r in reasons)


def test_a_checkpoint_is_not_pruned_while_its_replication_is_running(
    tmp_path: Path, memory_root: str
) -> None:
    gate = threading.Event()
    writer = _SlowWriter(tmp_path, replicate_to=memory_root)
    assert writer.remote is not None
    makedirs = writer.remote.makedirs

    def gated_makedirs(rel: str) -> None:
        assert gate.wait(_GATE_TIMEOUT_S)
        makedirs(rel)

    writer.remote.makedirs = gated_makedirs  # type: ignore[method-assign]
    manager = _manager(Topology.of(tmp_path, replicate_to=memory_root), writer, keep_last=2)
    handles = [manager.save(step, make_state(step)) for step in (1, 2, 3)]
    assert all(h is not None and h.committed.result(_GATE_TIMEOUT_S) for h in handles)
    # 1 is still replicating; without that, 1 would go (keep_last=2 keeps 2 and 3).
    assert _names(tmp_path) == [_name(1), _name(2), _name(3)]
    assert _events(tmp_path, "pruned") == []
    gate.set()
    manager.close(_GATE_TIMEOUT_S)  # drains replication, then prunes once more
    assert _names(tmp_path) == [_name(2), _name(3)]
    assert _events(tmp_path, "pruned") == [1]
    assert _events(tmp_path, "committed", tier="remote") == [1, 3]
    assert _events(tmp_path, "skipped", tier="remote") == [2]  # superseded by 3 while queued


def test_wait_and_close_raise_drain_timeout_while_a_save_is_in_flight(tmp_path: Path) -> None:
    gate = threading.Event()
    manager = _manager(tmp_path, _SlowWriter(tmp_path, gate=gate))
    handle = manager.save(1, make_state(1))
    with pytest.raises(DrainTimeoutError, match="in flight") as caught:
        manager.wait(0.01)
    assert isinstance(caught.value, TimeoutError)
    gate.set()
    assert handle is not None and handle.committed.result(_GATE_TIMEOUT_S) == _name(1)
    manager.close(_GATE_TIMEOUT_S)


def test_history_is_read_through_the_manager(tmp_path: Path) -> None:
    with _manager(tmp_path) as manager:
        manager.save(1, make_state(1))
        manager.wait(_GATE_TIMEOUT_S)
        events = [(e["event"], e["step"]) for e in manager.history()]
    assert events == [("requested", 1), ("committed", 1)]


def test_retention_prunes_the_remote_tier_too_once_replicated(
    tmp_path: Path, memory_root: str
) -> None:
    topology = Topology.of(tmp_path, replicate_to=memory_root)
    with CheckpointManager(topology, keep_last=2) as manager:
        for step in range(1, 5):
            handle = manager.save(step, make_state(step))
            assert handle is not None
            handle.replicated.result(timeout=60)
    remote = [c.name for c in dcp_safe.list_checkpoints(memory_root)]
    assert remote == [manager._name_for(3), manager._name_for(4)]
    pruned = [e for e in manager.history() if e["event"] == "pruned" and e["tier"] == "remote"]
    assert {e["step"] for e in pruned} == {1, 2}


def test_abandoned_partials_are_swept_by_prune(tmp_path: Path) -> None:
    partial = tmp_path / f".step_000000007.partial-{'dead' * 8}"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half")
    with CheckpointManager(tmp_path, retention=Retention(partial_grace_s=0)) as manager:
        manager.save(1, make_state(1))
    assert not partial.exists()


@pytest.mark.s3
def test_the_remote_tier_is_listed_and_read_with_the_replica_storage_options(
    tmp_path: Path,
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    # Only the replica needs endpoint and credentials; the local root takes none.
    local = tmp_path / "local"
    state = make_state(4)
    writer = SafeStorageWriter(local, replicate_to=Root(s3_root, storage_options=s3_options))
    with CheckpointManager(local, runtime=Runtime(writer=writer)) as manager:
        handle = manager.save(4, state)
        assert handle is not None
        handle.replicated.result(_GATE_TIMEOUT_S)
        assert manager.latest("remote") == _name(4)
        writer.backend.remove_tree(_name(4))
        restored = blank_like(state)
        assert manager.restore(restored, step=4) == _name(4)
        assert_state_equal(restored, state)


def test_a_managers_saves_never_change_the_writer_it_was_given(tmp_path: Path) -> None:
    """Each save runs on a per-step view of the writer (``writer.for_step``): the writer a user
    passed in keeps its own step, and every checkpoint records its own."""
    writer = SafeStorageWriter(tmp_path, options=WriterOptions(fsync=False), step=None)
    with CheckpointManager(tmp_path, keep_last=5, runtime=Runtime(writer=writer)) as manager:
        for step in (3, 4):
            handle = manager.save(step, {"w": torch.full((4,), float(step))})
            assert handle is not None
            handle.committed.result(timeout=60)
    assert writer.step is None
    assert [(c.name, c.step) for c in dcp_safe.list_checkpoints(tmp_path)] == [
        ("step_000000003", 3),
        ("step_000000004", 4),
    ]
