"""The coordinator's verdict against a peer's bounded wait for it, under real gloo ranks.

A coordinator whose own check of a new checkpoint outlasts the other ranks' wait for its verdict
(an outage slowing its reads: chaos seed 3047) must not record the save committed where they
recorded it failed. The verdict key is decided once: the late ``ok`` loses to the peer's claim,
every rank records the save failed, and the coordinator withdraws the checkpoint it committed, so
no checkpoint is listed without its ``committed`` event. The next save commits on every rank.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_safe import (
    Bounds,
    CheckpointManager,
    CommitError,
    Runtime,
    Topology,
    list_checkpoints,
)
from dcp_safe.errors import ReplicationTimeoutError
from dcp_safe.manager.saving import SaveRunner
from dcp_safe.replication.copying import CheckpointCopy
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.torch_compat import default_store

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WAIT_S = 1.0  # the peers' wait for the verdict (wait_timeout_s)
PEER_DONE = "test/peer_resolved_step_1"


def _hold_the_coordinators_first_check() -> None:
    """Rank 0's check of step 1 returns only once rank 1's save of step 1 has resolved (its
    wait for the verdict over): the gate the outage's slow reads made by chance."""
    check = SaveRunner._check

    def held(self: SaveRunner, handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = check(self, handle, *args, **kwargs)
        if handle.step == 1:  # bounded: on a fix that waits for it, the peer never resolves
            default_store().wait([PEER_DONE], timedelta(seconds=30 * WAIT_S))
        return result

    SaveRunner._check = held  # type: ignore[method-assign]


def _late_verdict(rank: int, world_size: int, root: str) -> dict[str, Any]:
    if rank == 0:
        _hold_the_coordinators_first_check()
    manager = CheckpointManager(
        root,
        keep_last=3,
        bounds=Bounds(deadline_s=30.0, wait_timeout_s=WAIT_S),
        runtime=Runtime(executor="thread"),
    )
    outcomes = {}
    for step in (1, 2):
        handle = manager.save(step, {f"rank{rank}.w": torch.full((64,), float(step))})
        assert handle is not None
        error = handle.committed.exception(timeout=120)
        outcomes[step] = "committed" if error is None else f"failed: {error}"
        if step == 1 and rank == 1:
            default_store().set(PEER_DONE, "1")
    with contextlib.suppress(CommitError):  # step 1's failure, raised once more
        manager.close(timeout_s=120)
    return {
        "outcomes": outcomes,
        "decisions": [(e["event"], e["step"], e.get("tier")) for e in manager.decisions()],
        "history": [(e["event"], e["name"]) for e in manager.history()],
    }


def test_a_verdict_later_than_the_peers_wait_fails_the_save_on_every_rank(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "ckpt")
    results = run_ranks(_late_verdict, 2, args=(root,), timeout_s=240)
    for result in results:
        assert result["outcomes"][1].startswith("failed:")
        assert "no verdict on the save from the coordinator" in result["outcomes"][1]
        assert result["outcomes"][2] == "committed"
    # The same events on every rank (their order across steps is each rank's timing).
    assert sorted(results[0]["decisions"]) == sorted(results[1]["decisions"])
    # Withdrawn by the coordinator: nothing listed lacks its committed event.
    assert [c.name for c in list_checkpoints(root)] == ["step_000000002"]
    committed = [name for event, name in results[0]["history"] if event == "committed"]
    assert committed == ["step_000000002"]


REMOTE_DONE = "test/peer_resolved_remote_step_1"


def _hold_the_coordinators_first_remote_commit() -> None:
    """Rank 0 publishes step 1 on the remote root (every file uploaded and checked, the marker
    next) only once rank 1's replication of it has resolved (its wait for the remote commit,
    then for the verdict, over): rank 0's commit retrying through an outage for longer than rank
    1 waits (chaos seed 3119)."""
    finish = CheckpointCopy.finish_upload

    def held(self: CheckpointCopy, dest: str) -> None:
        finish(self, dest)
        if self.name == "step_000000001":
            # Bounded: on a fix that waits for it, rank 1 never resolves.
            default_store().wait([REMOTE_DONE], timedelta(seconds=30 * WAIT_S))

    CheckpointCopy.finish_upload = held  # type: ignore[method-assign]


def _late_remote_commit(rank: int, world_size: int, local: str, remote: str) -> dict[str, Any]:
    if rank == 0:
        _hold_the_coordinators_first_remote_commit()
    manager = CheckpointManager(
        Topology.of(local, replicate_to=remote),
        keep_last=3,
        bounds=Bounds(deadline_s=30.0, wait_timeout_s=WAIT_S),
        runtime=Runtime(executor="thread"),
    )
    outcomes = {}
    for step in (1, 2):
        handle = manager.save(step, {f"rank{rank}.w": torch.full((64,), float(step))})
        assert handle is not None
        handle.committed.result(timeout=120)
        error = handle.replicated.exception(timeout=120)
        outcomes[step] = "replicated" if error is None else f"failed: {error}"
        if step == 1 and rank == 1:
            default_store().set(REMOTE_DONE, "1")
    with contextlib.suppress(CommitError, ReplicationTimeoutError):  # step 1's, raised again
        manager.close(timeout_s=120)
    return {
        "outcomes": outcomes,
        "decisions": [(e["event"], e["step"], e.get("tier")) for e in manager.decisions()],
        "history": [(e["event"], e["name"], e.get("tier")) for e in manager.history()],
    }


def test_a_remote_commit_later_than_the_peers_wait_fails_the_replication_on_every_rank(
    tmp_path: Path,
) -> None:
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    results = run_ranks(_late_remote_commit, 2, args=(local, remote), timeout_s=240)
    for result in results:
        assert result["outcomes"][1].startswith("failed:"), result["outcomes"]
        assert result["outcomes"][2] == "replicated"
    assert sorted(results[0]["decisions"]) == sorted(results[1]["decisions"])
    # Rank 0's late remote commit lost: withdrawn, so the remote root lists only what every
    # rank recorded replicated.
    assert [c.name for c in list_checkpoints(remote)] == ["step_000000002"]
    replicated = [
        n for event, n, tier in results[0]["history"] if event == "committed" and tier == "remote"
    ]
    assert replicated == ["step_000000002"]
