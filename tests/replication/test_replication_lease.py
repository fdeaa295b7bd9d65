"""Replication to a marker-published remote holds the name's writing lease (#17).

Two replications of different checkpoints under one name, or a replica and a direct save, must
never write under ``<name>/`` at once; two writers of the same checkpoint (same save id) share
the lease. Both lease kinds run here: the exclusive ``_WRITING`` and per-save leases (a backend
that says it has no exclusive create, or S3 behind a proxy that drops ``If-None-Match``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from s3_fixtures import BLOCK_BYTES
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import CommitError, SafeStorageReader, SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.backend import Backend, WritableFile
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.commit.lease import acquire_lease, lease_files
from dcp_safe.errors import CheckpointExistsError
from dcp_safe.replication.rank_upload import UploadOptions
from dcp_safe.replication.replicator import RankReplicator, RankSave, replicate_checkpoint
from dcp_safe.retention.sweeper import sweep_partials
from dcp_safe.testing import world
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy

# Only a guard against a hung test, never a measure of speed.
_TIMEOUT_S = 120.0
_RANKS = 3


# --------------------------------------------------------------------- helpers


def _save(root: Path, name: str, seed: int, **options: Any) -> dict[str, Any]:
    state = make_state(seed)
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False, **options))
    dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)
    return state


def _load(root: str, like: dict[str, Any], **options: Any) -> dict[str, Any]:
    target = blank_like(like)
    reader = SafeStorageReader(root, **options)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    return target


def _save_id(local: Path) -> str:
    return open_committed(open_backend(str(local)), "step_1").manifest.save_id


def _remote(root: str, *, exclusive: bool) -> Backend:
    backend = open_backend(root, fsync=False)
    backend.supports_exclusive_create = exclusive
    return backend


def _lease_name(backend: Backend, save_id: str) -> str:
    return layout.lease_file_name(None if backend.supports_exclusive_create else save_id)


def _is_lease(rel: str) -> bool:
    return layout.is_lease_file(rel.rpartition("/")[2])


class _Gate:
    """Holds every replication through ``backend`` at its first file upload (its lease is
    taken by then) until :attr:`opened` is set."""

    def __init__(self, backend: Backend) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        self._open_write = backend.open_write
        backend.open_write = self._held  # type: ignore[method-assign]

    def _held(self, rel: str) -> AbstractContextManager[WritableFile]:
        self.reached.set()
        assert self.opened.wait(_TIMEOUT_S), "test gate never opened"
        return self._open_write(rel)


def _record_writes(backend: Backend, into: list[str] | None = None) -> list[str]:
    """Record every write through ``backend``: a lease once it is written, a file when its
    write begins (so a lease listed before a file was there before that file began)."""
    written = [] if into is None else into
    write_bytes, open_write = backend.write_bytes, backend.open_write

    def record_bytes(rel: str, data: bytes, *, exclusive: bool = False) -> None:
        if not _is_lease(rel):
            written.append(rel)
        write_bytes(rel, data, exclusive=exclusive)
        if _is_lease(rel):
            written.append(rel)

    def record_open(rel: str) -> AbstractContextManager[WritableFile]:
        written.append(rel)
        return open_write(rel)

    backend.write_bytes = record_bytes  # type: ignore[method-assign]
    backend.open_write = record_open  # type: ignore[method-assign]
    return written


# --------------------------------------------------------------------- fixtures


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "local"


@pytest.fixture(params=[True, False], ids=["exclusive", "per_save"])
def exclusive(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def remote(memory_root: str, exclusive: bool) -> Backend:
    return _remote(memory_root, exclusive=exclusive)


@pytest.fixture(params=["conditional", "ignores_if_none_match"])
def s3_remote(
    request: pytest.FixtureRequest, s3: LocalS3, s3_root: str, s3_options: dict[str, Any]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """An S3 root with a real exclusive create, or behind a proxy that drops If-None-Match
    (per-save leases)."""
    if request.param == "conditional":
        yield s3_root, s3_options
        return
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.strip_header("If-None-Match", method="PUT")
        yield s3_root, proxy.storage_options(default_block_size=BLOCK_BYTES)


# --------------------------------------------------------------------- one process


@pytest.mark.s3
def test_a_replication_holding_the_name_refuses_another_checkpoint_of_it(
    tmp_path: Path, s3_remote: tuple[str, dict[str, Any]]
) -> None:
    root, options = s3_remote
    state = _save(tmp_path / "a", "step_1", 1)
    _save(tmp_path / "b", "step_1", 2)
    holder = _save_id(tmp_path / "a")
    first_remote = open_backend(root, options)
    gate = _Gate(first_remote)
    source = open_backend(str(tmp_path / "a"))

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(replicate_checkpoint, source, first_remote, "step_1")
        try:
            assert gate.reached.wait(_TIMEOUT_S)
            second_remote = open_backend(root, options)
            written = _record_writes(second_remote)
            with pytest.raises(CheckpointExistsError, match=holder):
                replicate_checkpoint(open_backend(str(tmp_path / "b")), second_remote, "step_1")
            assert [rel for rel in written if not _is_lease(rel)] == []
            assert list(second_remote.walk_files("step_1")) == [_lease_name(second_remote, holder)]
        finally:
            gate.opened.set()
        assert first.result(timeout=_TIMEOUT_S).save_id == holder

    dcp_safe.verify_checkpoint(root, "step_1", storage_options=options)
    assert_state_equal(_load(root, state, storage_options=options), state)
    assert lease_files(open_backend(root, options), "step_1") == []


def test_a_crashed_replications_lease_does_not_block_a_retry_of_the_same_checkpoint(
    local: Path, remote: Backend, memory_root: str
) -> None:
    state = _save(local, "step_1", 1)
    acquire_lease(remote, "step_1", _save_id(local))  # the crashed attempt's lease...
    remote.write_bytes("step_1/__0_0.distcp", b"torn")  # ...and part of an upload

    replicate_checkpoint(open_backend(str(local)), remote, "step_1")

    dcp_safe.verify_checkpoint(memory_root, "step_1")
    assert_state_equal(_load(memory_root, state), state)
    assert lease_files(remote, "step_1") == []


@pytest.mark.s3
def test_a_crashed_replications_leftovers_are_swept_after_the_grace_period(
    local: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    """The sweeper needs no change: a replication's lease is a lease like a save's."""
    state = _save(local, "step_1", 1)
    remote = open_backend(s3_root, s3_options)
    acquire_lease(remote, "step_1", _save_id(local))  # what a killed replication leaves
    remote.write_bytes("step_1/__0_0.distcp", b"half a shard")

    report = sweep_partials(s3_root, grace_s=60, now=time.time() + 61, storage_options=s3_options)

    assert report.removed == ("step_1",)
    assert list(remote.walk_files("step_1")) == []
    replicate_checkpoint(open_backend(str(local)), remote, "step_1")
    assert_state_equal(_load(s3_root, state, storage_options=s3_options), state)


def test_a_lease_of_another_save_blocks_a_replication_before_it_uploads(
    local: Path, remote: Backend
) -> None:
    _save(local, "step_1", 1)
    acquire_lease(remote, "step_1", "other-save")
    written = _record_writes(remote)

    with pytest.raises(CheckpointExistsError, match="other-save"):
        replicate_checkpoint(open_backend(str(local)), remote, "step_1")

    assert [rel for rel in written if not _is_lease(rel)] == []
    assert list(remote.walk_files("step_1")) == [_lease_name(remote, "other-save")]


def test_the_lease_is_gone_after_a_failed_replication_and_after_a_successful_one(
    local: Path, remote: Backend, memory_root: str
) -> None:
    state = _save(local, "step_1", 1, thread_count=2)
    open_write = remote.open_write
    opened: list[str] = []

    def fail_the_second(rel: str) -> AbstractContextManager[WritableFile]:
        opened.append(rel)
        if len(opened) == 2:  # one shard is uploaded by then
            raise OSError(5, "injected remote failure", rel)
        return open_write(rel)

    remote.open_write = fail_the_second  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected remote failure"):
        replicate_checkpoint(open_backend(str(local)), remote, "step_1")
    assert list(remote.walk_files("")) == []
    assert remote.list_dir("") == []

    remote.open_write = open_write  # type: ignore[method-assign]
    replicate_checkpoint(open_backend(str(local)), remote, "step_1")
    assert lease_files(remote, "step_1") == []
    dcp_safe.verify_checkpoint(memory_root, "step_1")
    assert_state_equal(_load(memory_root, state), state)


def test_two_replicators_of_one_checkpoint_share_the_lease_and_both_succeed(
    local: Path, memory_root: str, exclusive: bool
) -> None:
    """The second joins the first's lease, publishes and releases it; the first then finds
    its lease gone, and the name committed with its own digest: success."""
    state = _save(local, "step_1", 1, thread_count=2)  # two shards: the first checks again
    first_remote = _remote(memory_root, exclusive=exclusive)
    gate = _Gate(first_remote)
    source = open_backend(str(local))

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(replicate_checkpoint, source, first_remote, "step_1")
        try:
            assert gate.reached.wait(_TIMEOUT_S)
            if exclusive:  # a direct save of that name is refused meanwhile, as any save is
                with pytest.raises(CheckpointExistsError, match=_save_id(local)):
                    writer = SafeStorageWriter(memory_root, options=WriterOptions(fsync=False))
                    dcp_safe.save(make_state(3), checkpoint_id="step_1", storage_writer=writer)
            second = replicate_checkpoint(
                source, _remote(memory_root, exclusive=exclusive), "step_1"
            )
        finally:
            gate.opened.set()
        assert first.result(timeout=_TIMEOUT_S) == second

    dcp_safe.verify_checkpoint(memory_root, "step_1")
    assert_state_equal(_load(memory_root, state), state)
    assert lease_files(open_backend(memory_root), "step_1") == []


# --------------------------------------------------------------------- several ranks


def _multi_rank_checkpoint(local: Path) -> str:
    backend = open_backend(str(local), fsync=False)
    save = world.simulate(backend, "step_1", _RANKS)
    world.publish(backend, save)
    return save.save_id


def _replicate_ranks(
    local: Path, remotes: list[Backend], save_id: str
) -> list[BaseException | None]:
    """Every rank's RankReplicator, each with its own remote backend; their outcomes."""
    options = UploadOptions(remote_timeout_s=_TIMEOUT_S, poll_s=0.05)
    replicators = [
        RankReplicator(open_backend(str(local)), remote, options=options) for remote in remotes
    ]
    futures = [
        replicator.begin("step_1", RankSave(save_id, rank, _RANKS))
        for rank, replicator in enumerate(replicators)
    ]
    outcomes = [future.exception(timeout=_TIMEOUT_S) for future in futures]
    for replicator in replicators:
        replicator.close(timeout_s=_TIMEOUT_S)
    return outcomes


def test_ranks_upload_only_once_rank_0_holds_the_lease_and_commit(
    local: Path, memory_root: str, exclusive: bool
) -> None:
    save_id = _multi_rank_checkpoint(local)
    remotes = [_remote(memory_root, exclusive=exclusive) for _ in range(_RANKS)]
    written: list[str] = []
    for remote in remotes:
        _record_writes(remote, written)

    assert _replicate_ranks(local, remotes, save_id) == [None] * _RANKS

    leases = [rel for rel in written if _is_lease(rel)]
    assert leases == [f"step_1/{_lease_name(remotes[0], save_id)}"]  # taken once
    assert _is_lease(written[0])  # before any rank uploaded a byte
    dcp_safe.verify_checkpoint(memory_root, "step_1")
    assert open_committed(remotes[0], "step_1").manifest.save_id == save_id
    assert lease_files(remotes[0], "step_1") == []


def test_every_rank_fails_typed_and_uploads_nothing_when_another_save_holds_the_name(
    local: Path, memory_root: str, exclusive: bool
) -> None:
    save_id = _multi_rank_checkpoint(local)
    remotes = [_remote(memory_root, exclusive=exclusive) for _ in range(_RANKS)]
    acquire_lease(remotes[0], "step_1", "other-save")

    outcomes = _replicate_ranks(local, remotes, save_id)

    assert isinstance(outcomes[0], CheckpointExistsError)
    for outcome in outcomes[1:]:
        assert isinstance(outcome, CommitError) and "other-save" in str(outcome)
    left = sorted(remotes[0].walk_files("step_1"))
    assert left == sorted(
        [f"{layout.COMMIT_FAILED_PREFIX}{save_id}", _lease_name(remotes[0], "other-save")]
    )
