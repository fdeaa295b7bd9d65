"""RankReplicator's storage protocol on one process: skips and failed saves reach every rank.

The multi-rank uploads themselves run on real gloo ranks in
``tests/adapters/test_multirank_replication.py``; here one rank's replicator runs alone against a
local root where nothing gets committed, which is enough to see what its peers would see.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_safe
from dcp_safe import CommitError, ConfigError, SafeStorageWriter, StorageError
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import ReplicationSkippedError
from dcp_safe.replication.rank_upload import (
    UploadOptions,
    await_arrivals,
    await_remote_commit,
    raise_reported_failures,
    report_commit_failure,
    report_rank_failure,
)
from dcp_safe.replication.replicator import RankReplicator, RankSave

_TIMEOUT_S = 60.0


def _save_id(letter: str) -> str:
    return letter * 32


def test_a_save_skipped_on_one_rank_is_skipped_on_every_rank(
    tmp_path: Path, memory_root: str
) -> None:
    local, remote = open_backend(str(tmp_path)), open_backend(memory_root)
    # A slow poll: the first save is still waiting for its local commit when the next two begin.
    options = UploadOptions(remote_timeout_s=_TIMEOUT_S, poll_s=1.0)
    replicator = RankReplicator(local, remote, options=options)
    first = replicator.begin("step_1", RankSave(_save_id("a"), 1, 2))
    deadline = time.monotonic() + _TIMEOUT_S
    while not first.running() and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker took it: the next save is pending, not replacing it
    second = replicator.begin("step_2", RankSave(_save_id("b"), 1, 2))
    third = replicator.begin("step_3", RankSave(_save_id("c"), 1, 2))

    with pytest.raises(ReplicationSkippedError):
        second.result(timeout=_TIMEOUT_S)
    assert replicator.skipped == ["step_2"]
    # Rank 0, waiting for this rank's part of step_2, learns of the skip from storage.
    work = strategy_for(remote).work_dir("step_2", _save_id("b"))
    with pytest.raises(ReplicationSkippedError) as seen:
        await_arrivals(remote, work, _save_id("b"), "step_2", 2, options)
    assert (seen.value.name, seen.value.superseded_by) == ("step_2", "step_3")

    # step_1 ended, uncommitted, when step_2 began: its wait ends there, not at its deadline.
    with pytest.raises(CommitError, match="not committed locally"):
        first.result(timeout=_TIMEOUT_S)
    # close() ends step_3 the same way; nobody looked at its future, so close() raises it.
    with pytest.raises(CommitError, match="not committed locally"):
        replicator.close(timeout_s=_TIMEOUT_S)
    assert third.done()
    with pytest.raises(ConfigError):
        replicator.begin("step_4", RankSave(_save_id("d"), 1, 2))


def test_failure_markers_name_the_ranks_and_belong_to_one_save(memory_root: str) -> None:
    remote = open_backend(memory_root)
    work = strategy_for(remote).work_dir("step_1", _save_id("a"))
    assert raise_reported_failures(remote, work, _save_id("a"), "step_1") == set()

    report_rank_failure(remote, work, 3, _save_id("a"), OSError("disk on fire"))
    with pytest.raises(CommitError, match="disk on fire") as seen:
        raise_reported_failures(remote, work, _save_id("a"), "step_1")
    assert list(seen.value.failures) == [3]
    # A later save of the same name does not see the stale marker.
    assert raise_reported_failures(remote, work, _save_id("b"), "step_1") == {
        f"rank_00003.failed-{_save_id('a')}"
    }

    report_commit_failure(remote, work, _save_id("b"), TimeoutError("no quorum"))
    with pytest.raises(CommitError, match="remote commit failed") as seen:
        raise_reported_failures(remote, work, _save_id("b"), "step_1")
    assert seen.value.failures == {0: "TimeoutError: no quorum"}


def test_a_renaming_remote_gets_its_markers_in_the_partial_directory(tmp_path: Path) -> None:
    remote = open_backend(str(tmp_path))
    work = strategy_for(remote).work_dir("step_1", _save_id("a"))
    assert work.startswith(".step_1.partial-")
    report_rank_failure(remote, work, 1, _save_id("a"), OSError("gone"))  # no directory yet
    with pytest.raises(CommitError, match="gone"):
        raise_reported_failures(remote, work, _save_id("a"), "step_1")


def test_a_rank_waiting_for_the_remote_commit_rides_out_an_outage_of_its_listings(
    memory_root: str,
) -> None:
    """Chaos seed 8017: the store is down for longer than one listing's retry budget while
    rank 0 commits. A peer's wait must see the commit once the store is back, not fail alone
    on the first listing that gave up (the ranks would then disagree on one save)."""
    dcp_safe.save(
        {"w": torch.arange(4.0)},
        checkpoint_id="step_1",
        storage_writer=SafeStorageWriter(memory_root),
    )
    remote = open_backend(memory_root)
    save_id = open_committed(remote, "step_1").manifest.save_id
    up_at = time.monotonic() + 0.5
    failed: list[str] = []

    def down_for_a_while(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if time.monotonic() < up_at:
                failed.append(method.__name__)
                raise StorageError(
                    method.__name__, str(args[:1]), "Service is unable to handle request"
                )
            return method(*args, **kwargs)

        return call

    for attr in ("list_dir", "exists", "read_small", "read_bytes", "open_read"):
        if hasattr(remote, attr):
            setattr(remote, attr, down_for_a_while(getattr(remote, attr)))
    work = strategy_for(remote).work_dir("step_1", save_id)
    options = UploadOptions(remote_timeout_s=_TIMEOUT_S, poll_s=0.05)

    manifest = await_remote_commit(remote, "step_1", work, save_id, options)

    assert manifest.save_id == save_id
    assert "list_dir" in failed  # the failure-marker listing did fail during the outage
