"""SafeStorageWriter(replicate_to=...): the local commit first, then the remote one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import ConfigError, SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.topology import Root


@pytest.fixture
def remote(memory_root: str) -> str:
    return memory_root


def _restore(root: str, like: dict[str, Any], **options: Any) -> dict[str, Any]:
    target = blank_like(like)
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=SafeStorageReader(root, **options))
    return target


def test_a_local_commit_is_replicated_and_restores_from_the_remote_alone(
    tmp_path: Path, remote: str
) -> None:
    state = make_state(3)
    writer = SafeStorageWriter(tmp_path, replicate_to=remote)
    dcp_safe.save(state, checkpoint_id="step_3", storage_writer=writer)
    manifest = writer.replication("step_3").result(timeout=60)
    assert manifest.name == "step_3"
    dcp_safe.verify_checkpoint(remote, "step_3")
    assert_state_equal(_restore(remote, state), state)
    writer.close(timeout_s=60)


def test_async_save_then_replication_future(tmp_path: Path, remote: str) -> None:
    state = make_state(4)
    writer = SafeStorageWriter(tmp_path, replicate_to=remote)
    dcp.async_save(state, checkpoint_id="step_4", storage_writer=writer, no_dist=True).result(60)
    writer.replication("step_4").result(timeout=60)
    assert [c.name for c in dcp_safe.list_checkpoints(remote)] == ["step_4"]
    writer.close(timeout_s=60)


def test_ranks_that_do_not_publish_learn_of_the_remote_commit_from_storage(
    tmp_path: Path, remote: str
) -> None:
    publisher = SafeStorageWriter(tmp_path, replicate_to=remote)
    bystander = SafeStorageWriter(tmp_path, replicate_to=remote)  # as on rank 1: no replicator
    watched = bystander.replication("step_5", poll_s=0.05)
    dcp_safe.save(make_state(5), checkpoint_id="step_5", storage_writer=publisher)
    assert watched.result(timeout=60).save_id == publisher.replication("step_5").result(60).save_id
    publisher.close(timeout_s=60)


def test_replication_needs_a_remote(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        SafeStorageWriter(tmp_path).replication("step_1")


@pytest.mark.s3
def test_replication_to_s3_and_restore_from_s3_alone(
    tmp_path: Path,
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    state = make_state(6)
    writer = SafeStorageWriter(
        tmp_path,
        replicate_to=Root(s3_root, storage_options=s3_options),
        options=WriterOptions(compression="zstd"),
    )
    dcp_safe.save(state, checkpoint_id="step_6", storage_writer=writer)
    writer.replication("step_6").result(timeout=120)
    dcp_safe.verify_checkpoint(s3_root, "step_6", storage_options=s3_options)
    assert_state_equal(_restore(s3_root, state, storage_options=s3_options), state)
    writer.close(timeout_s=60)


def test_a_save_through_a_per_step_view_records_its_step_and_leaves_the_writer_alone(
    tmp_path: Path, remote: str
) -> None:
    """``for_step`` is how the manager saves: the step reaches the manifest, the shared writer
    is never changed, and the view's replication is the writer's (one background upload)."""
    writer = SafeStorageWriter(tmp_path, replicate_to=remote)
    dcp_safe.save(make_state(7), checkpoint_id="step_7", storage_writer=writer.for_step(7))
    assert writer.step is None
    writer.replication("step_7").result(timeout=60)  # the view's upload, found by the writer
    assert [(c.name, c.step) for c in dcp_safe.list_checkpoints(remote)] == [("step_7", 7)]
    writer.close(timeout_s=60)
