"""Saves, loads and replication to S3 through a fault-injecting proxy in front of moto.

What must hold: transient faults (500, SlowDown, a lost reply) are survived with a bit-exact
result; a persistent fault fails the save within the configured deadline, publishes nothing
remotely, and leaves the local checkpoint intact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, StorageError, layout
from dcp_safe.backends.retry import RetryPolicy
from dcp_safe.testing.s3_proxy import FaultProxy
from dcp_safe.topology import Root

pytestmark = pytest.mark.s3

DEADLINE_S = 3.0
# Generous: without our own deadline, s3fs and botocore together take ~40 s to give up.
SLACK_S = 15.0


@pytest.fixture
def root(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/faults"


def _options(proxy: FaultProxy) -> dict[str, Any]:
    return proxy.storage_options(
        config_kwargs={"connect_timeout": 2, "read_timeout": 2},
        default_block_size=5 * 2**20,
    )


def _policy() -> RetryPolicy:
    return RetryPolicy(deadline_s=DEADLINE_S, base_delay_s=0.05, max_delay_s=0.5)


def _save(root: str, proxy: FaultProxy, state: dict[str, Any], name: str = "step_1") -> None:
    writer = SafeStorageWriter(root, storage_options=_options(proxy), retry=_policy())
    dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)


def _load(root: str, proxy: FaultProxy, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    reader = SafeStorageReader(root, storage_options=_options(proxy), retry=_policy())
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=reader)
    return target


@pytest.mark.parametrize(
    ("status", "code"), [(500, "InternalError"), (503, "SlowDown")], ids=["500", "SlowDown"]
)
def test_one_off_server_errors_on_shards_and_marker_are_survived(
    root: str, proxy: FaultProxy, status: int, code: str
) -> None:
    state = make_state(1)
    shard = proxy.fail(status, code, method="PUT", key=".distcp", times=1)
    marker = proxy.fail(status, code, method="PUT", key=layout.COMMITTED_MARKER, times=1)
    _save(root, proxy, state)
    assert shard.hits == 1 and marker.hits == 1
    read = proxy.fail(status, code, method="GET", key=".distcp", times=1)
    assert_state_equal(_load(root, proxy, state), state)
    assert read.hits == 1
    dcp_safe.verify_checkpoint(root, "step_1", storage_options=_options(proxy))


def test_a_lost_reply_on_the_marker_is_recognised_as_our_own_commit(
    root: str, proxy: FaultProxy
) -> None:
    state = make_state(2)
    dropped = proxy.drop_reply(method="PUT", key=layout.COMMITTED_MARKER, times=2)
    _save(root, proxy, state)
    assert dropped.hits >= 1
    assert [c.name for c in dcp_safe.list_checkpoints(root, storage_options=_options(proxy))] == [
        "step_1"
    ]
    assert_state_equal(_load(root, proxy, state), state)


def test_a_persistent_fault_fails_the_save_within_the_deadline_publishing_nothing(
    root: str, proxy: FaultProxy
) -> None:
    proxy.fail(503, "SlowDown", method="PUT", key=".distcp", times=None)
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        _save(root, proxy, make_state(3))
    assert time.monotonic() - started < DEADLINE_S + SLACK_S
    assert "s3://" in str(info.value) and ".distcp" in str(info.value)
    proxy.clear()
    assert dcp_safe.list_checkpoints(root, storage_options=_options(proxy)) == []


def test_a_persistent_remote_fault_fails_replication_in_time_and_keeps_the_local_commit(
    tmp_path: Path, root: str, proxy: FaultProxy
) -> None:
    state = make_state(4)
    writer = SafeStorageWriter(
        tmp_path,
        replicate_to=Root(root, storage_options=_options(proxy)),
        retry=_policy(),
    )
    proxy.fail(503, "SlowDown", method="PUT", times=None)
    started = time.monotonic()
    dcp_safe.save(state, checkpoint_id="step_4", storage_writer=writer)
    with pytest.raises(StorageError):
        writer.replication("step_4").result(timeout=DEADLINE_S + SLACK_S)
    assert time.monotonic() - started < DEADLINE_S + SLACK_S
    proxy.clear()
    assert dcp_safe.list_checkpoints(root, storage_options=_options(proxy)) == []
    dcp_safe.verify_checkpoint(tmp_path, "step_4")
    target = blank_like(state)
    dcp_safe.load(target, checkpoint_id="step_4", storage_reader=SafeStorageReader(tmp_path))
    assert_state_equal(target, state)
    writer.close(timeout_s=30)
