"""``Runtime(read_only=True)``: an evaluation job's manager beside a training run's.

It lists, restores and follows the root while training saves into it, and writes nothing: the
root's tree (every path and every file's bytes) is the same before and after its calls, an
abandoned partial a sweep would remove included, and each write call raises ConfigError.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, blank_like, make_state
from support.faults import abandon_a_save

import dcp_safe
from dcp_safe import CheckpointManager, ConfigError, Retention, Runtime, Topology
from dcp_safe.coordination import group as group_registry
from dcp_safe.reading.peers import PEER_RESTORE
from dcp_safe.replication.peer_copy import PEER_COPIES
from dcp_safe.testing.multiproc import run_ranks

_EVENT_TIMEOUT_S = 120  # a safety net against a hang, never an assertion
READ_ONLY = Runtime(read_only=True)


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root``: a folder as ``/``, a file as the hash of its bytes."""
    found: dict[str, str] = {}
    for folder, folders, files in os.walk(root):
        for name in folders:
            found[os.path.relpath(os.path.join(folder, name), root)] = "/"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _step_of(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def _restore_latest(reader: CheckpointManager) -> int:
    target = blank_like(make_state(0))
    name = reader.restore(target)
    assert_state_equal(target, make_state(_step_of(name)))
    return _step_of(name)


def test_a_read_only_manager_follows_training_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    paused, go, restored_meanwhile = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    trained: list[tuple[str, int]] = []  # the training manager's own record of events

    def train() -> None:
        try:
            with CheckpointManager(root, keep_last=3) as trainer:
                for step in range(1, 13):
                    trainer.save(step, make_state(step)).committed.result()  # type: ignore[union-attr]
                    if step == 6:
                        paused.set()
                        assert go.wait(_EVENT_TIMEOUT_S)
                    if step == 8:  # the reader restores while training goes on
                        assert restored_meanwhile.wait(_EVENT_TIMEOUT_S)
            trained.extend((e["event"], e["step"]) for e in trainer.decisions())
        except BaseException as exc:
            errors.append(exc)
            paused.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    reader = CheckpointManager(root, retention=Retention(partial_grace_s=1.0), runtime=READ_ONLY)
    assert paused.wait(_EVENT_TIMEOUT_S) and not errors
    # An abandoned save, old enough for any sweep: the reader must leave it where it is.
    partial = root / abandon_a_save(root, "step_000000099")
    old = time.time() - 7 * 3600  # past the training manager's grace (6 h) too
    for folder, _, files in os.walk(partial):
        for name in [*files, "."]:
            os.utime(os.path.join(folder, name), (old, old))
    before = _tree(root)

    assert reader.latest() == "step_000000006"  # read now, not when the reader was built
    assert _restore_latest(reader) == 6
    target = blank_like(make_state(0))
    assert reader.restore(target, step=5, audit=True) == "step_000000005"
    assert_state_equal(target, make_state(5))
    assert [c.name for c in dcp_safe.list_checkpoints(root)][-1] == "step_000000006"
    assert dcp_safe.verify_checkpoint(root, "step_000000006").files_checked > 0
    assert [e["step"] for e in reader.history() if e["event"] == "committed"] == list(range(1, 7))
    for call in (
        lambda: reader.save(7, make_state(7)),
        lambda: reader.maybe_save(7, make_state(7)),
        reader.prune,
        reader.install_preemption_handler,
    ):
        with pytest.raises(ConfigError, match="read-only"):
            call()
    assert _tree(root) == before

    go.set()
    while not errors and trainer.is_alive() and not restored_meanwhile.is_set():
        if _restore_latest(reader) >= 7:  # a save training committed after the pause
            restored_meanwhile.set()
    trainer.join(_EVENT_TIMEOUT_S)
    assert not errors and not trainer.is_alive()
    assert reader.latest() == "step_000000012"
    assert _restore_latest(reader) == 12
    reader.close()

    # The history holds what training recorded (its prunes besides), nothing of the reader's.
    history = [(e["event"], e["step"]) for e in reader.history()]
    assert [e for e in history if e[0] != "pruned"] == trained
    assert not any(event == "restored" for event, _ in history)
    assert not partial.exists()  # training's own sweep took it: the reader's would have too


def test_a_read_only_manager_creates_nothing_where_there_is_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "absent", runtime=READ_ONLY) as reader:
        assert reader.latest() is None and reader.executor == "thread"
        with pytest.raises(dcp_safe.CheckpointNotFoundError):
            reader.restore({"w": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_read_only_is_a_shorthand_of_the_runtime_option(tmp_path: Path) -> None:
    """``CheckpointManager(root, read_only=True)`` (issue 47's spelling) is the Runtime field."""
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.read_only
        with pytest.raises(ConfigError, match="read-only"):
            reader.save(1, {"w": torch.zeros(2)})
    with CheckpointManager(tmp_path, read_only=False, runtime=READ_ONLY) as writer:
        assert not writer.read_only  # the shorthand given replaces its one field
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="read_only"):
        Runtime(read_only="yes")  # type: ignore[arg-type]


def _peer_tier(rank: int, nodes: list[str], remote: str) -> Topology:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per node: rank r is node r
    return Topology.of(remote, node_local=nodes[rank], peer_copies=2)


def _own_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return {f"rank{rank}": torch.randn(64, generator=gen)}


def _group_purposes() -> set[str]:
    """The purposes of the groups dcp_safe's coordination layer has created in this process."""
    return {purpose for _, _, purpose in group_registry._groups}


def _train_with_peer_copies(rank: int, world_size: int, nodes: list[str], remote: str) -> Any:
    with CheckpointManager(_peer_tier(rank, nodes, remote)) as trainer:
        for step in (1, 2):
            trainer.save(step, _own_state(rank, step)).committed.result(timeout=120)  # type: ignore[union-attr]
        trainer.wait(timeout_s=120)  # the peer copies too
        return trainer.stats().peer_copies, _group_purposes()


def _evaluate(rank: int, world_size: int, nodes: list[str], remote: str) -> Any:
    with CheckpointManager(_peer_tier(rank, nodes, remote), runtime=READ_ONLY) as reader:
        listed = [c.name for c in dcp_safe.list_checkpoints(remote)]
        target = {f"rank{rank}": torch.zeros(64)}
        name = reader.restore(target, step=1)
        exact = torch.equal(target[f"rank{rank}"], _own_state(rank, 1)[f"rank{rank}"])
        return reader.latest(), listed, name, exact, reader._tiers.peers, _group_purposes()


@pytest.mark.multiproc
def test_a_read_only_manager_builds_no_peer_tier_group(tmp_path: Path) -> None:
    """A read-only manager makes no peer copies and fetches none (they would land on this
    node's disk): it forms neither peer-tier group, where a writing one forms both."""
    nodes, remote = [str(tmp_path / "node_a"), str(tmp_path / "node_b")], str(tmp_path / "remote")
    peer_groups = {PEER_COPIES, PEER_RESTORE}
    for copies, purposes in run_ranks(_train_with_peer_copies, 2, args=(nodes, remote)):
        assert copies == 2 and peer_groups <= purposes  # the registry sees a peer tier's groups
    for latest, listed, name, exact, peers, purposes in run_ranks(
        _evaluate, 2, args=(nodes, remote)
    ):
        assert (latest, listed) == ("step_000000002", ["step_000000001", "step_000000002"])
        assert (name, exact, peers) == ("step_000000001", True, None)
        assert not peer_groups & purposes
