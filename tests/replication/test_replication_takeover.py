"""A restarted job replicates over the remote lease its killed predecessor's replication left.

The case: a job replicating ``step_1`` to an object store is killed mid-upload; its node is
replaced, so the restart restores an earlier step from the remote, runs to ``step_1`` again,
commits it locally (a new checkpoint, a new save id) and replicates it. The remote name still
holds the killed replication's lease and uploads. Real saves and replication (the writer's own
replicator); the kill is what it leaves: the lease and the objects, with no clean-up run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.commit.fencing import ATTEMPT_ENV, RUN_ID_ENV
from dcp_safe.commit.replica import ReplicaPublication
from dcp_safe.topology import Root

_TIMEOUT_S = 120.0  # only a guard against a hung test

Remote = tuple[str, dict[str, Any] | None, bool]


@pytest.fixture(autouse=True)
def _no_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


@pytest.fixture(params=["exclusive", "per_save", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, memory_root: str) -> Remote:
    if request.param == "s3":
        url = request.getfixturevalue("s3_root")
        return url, request.getfixturevalue("s3_options"), True
    return memory_root, None, request.param == "exclusive"


class _Killed(Exception):
    """Where the kill lands: right before the remote manifest, every shard uploaded."""


def _writer(local: Path, remote: Remote, attempt: int, thread_count: int = 1) -> SafeStorageWriter:
    url, options, exclusive = remote
    writer = SafeStorageWriter(
        local,
        replicate_to=Root(url, storage_options=options),
        attempt=attempt,
        options=WriterOptions(fsync=False, thread_count=thread_count),
    )
    assert writer.remote is not None
    writer.remote.supports_exclusive_create = exclusive
    return writer


def _kill_before_the_manifest(writer: SafeStorageWriter) -> None:
    assert writer.remote is not None
    write: Callable[..., None] = writer.remote.write_bytes

    def write_bytes(rel: str, data: bytes, *, exclusive: bool = False) -> None:
        if rel.endswith(layout.MANIFEST):
            raise _Killed(rel)
        write(rel, data, exclusive=exclusive)

    writer.remote.write_bytes = write_bytes  # type: ignore[method-assign]


def test_a_restarted_attempt_replicates_over_the_lease_a_killed_replication_left(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, options, _ = remote
    killed = _writer(tmp_path / "node-a", remote, attempt=0, thread_count=3)
    _kill_before_the_manifest(killed)
    with monkeypatch.context() as patched:
        patched.setattr(
            ReplicaPublication, "abandon", lambda self, uploaded: None
        )  # killed: no clean-up
        dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=killed)
        with pytest.raises(_Killed):
            killed.replication("step_1").result(timeout=_TIMEOUT_S)
    left = set(open_backend(url, options).walk_files("step_1"))
    assert {"__0_0.distcp", "__0_1.distcp", "__0_2.distcp"} <= left
    assert any(layout.is_lease_file(rel) for rel in left)

    state = make_state(2)
    restarted = _writer(tmp_path / "node-b", remote, attempt=1)  # one shard file, not three
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=restarted)
    restarted.replication("step_1").result(timeout=_TIMEOUT_S)
    restarted.close(timeout_s=_TIMEOUT_S)

    dcp_safe.verify_checkpoint(url, "step_1", storage_options=options)
    target = blank_like(state)
    reader = SafeStorageReader(url, storage_options=options)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert_state_equal(target, state)
    backend = open_backend(url, options)
    manifest = open_committed(backend, "step_1").manifest
    own = {record.path for record in manifest.files} | {layout.MANIFEST, layout.COMMITTED_MARKER}
    assert sorted(backend.walk_files("step_1")) == sorted(own)
