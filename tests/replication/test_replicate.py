"""Replication to the remote tier: a committed local checkpoint copied, verified, committed."""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from s3_fixtures import BLOCK_BYTES
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    SafeStorageReader,
    SafeStorageWriter,
    WriterOptions,
    layout,
)
from dcp_safe.backends.backend import Backend, WritableFile
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.errors import (
    CheckpointExistsError,
    ReplicationSkippedError,
    ReplicationTimeoutError,
)
from dcp_safe.manifest.schema import Manifest
from dcp_safe.replication.replicator import Replicator, replicate_checkpoint
from dcp_safe.testing.s3 import LocalS3

# Generous: only a guard against a hung test, never a measure of speed.
_GATE_TIMEOUT_S = 120.0


# --------------------------------------------------------------------- helpers


def _save(root: Path | str, name: str, seed: int, **options: Any) -> dict[str, Any]:
    state = make_state(seed)
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False, **options))
    dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)
    return state


def _load(root: str, name: str, like: dict[str, Any], **options: Any) -> dict[str, Any]:
    target = blank_like(like)
    reader = SafeStorageReader(root, **options)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    return target


def _flip_byte_in_an_item(local: Path, name: str) -> str:
    """Flip one byte inside the f32 tensor's item; return the shard's file name."""
    manifest = open_committed(open_backend(str(local)), name).manifest
    item = next(i for i in manifest.items if i.fqn == "f32")
    path = local / name / item.file
    data = bytearray(path.read_bytes())
    data[item.start + item.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return item.file


class _Wrapped(Backend):
    """Delegates everything to ``inner``; tests override the calls they fault or observe."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_atomic_rename = inner.supports_atomic_rename
        self.supports_exclusive_create = inner.supports_exclusive_create

    def full_path(self, rel: str) -> str:
        return self.inner.full_path(rel)

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        return self.inner.open_write(rel)

    def open_read(self, rel: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_read(rel)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        self.inner.write_bytes(rel, data, exclusive=exclusive)

    def read_bytes(self, rel: str) -> bytes:
        return self.inner.read_bytes(rel)

    def size(self, rel: str) -> int:
        return self.inner.size(rel)

    def exists(self, rel: str) -> bool:
        return self.inner.exists(rel)

    def list_dir(self, rel: str) -> list[str]:
        return self.inner.list_dir(rel)

    def walk_files(self, rel: str) -> Iterator[str]:
        return self.inner.walk_files(rel)

    def is_dir(self, rel: str) -> bool:
        return self.inner.is_dir(rel)

    def makedirs(self, rel: str) -> None:
        self.inner.makedirs(rel)

    def remove_tree(self, rel: str) -> None:
        self.inner.remove_tree(rel)

    def remove_file(self, rel: str) -> None:
        self.inner.remove_file(rel)

    def sync_dir(self, rel: str) -> None:
        self.inner.sync_dir(rel)

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        return self.inner.publish_dir(src, dst, replace=replace)


class _Recording(_Wrapped):
    """Counts the calls that change the remote."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.changes: list[str] = []

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        self.changes.append(rel)
        return super().open_write(rel)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        self.changes.append(rel)
        super().write_bytes(rel, data, exclusive=exclusive)


class _FailingWrite(_Wrapped):
    """The ``fail_at``-th file written (streamed or small) fails with OSError, once: at open,
    or at its first chunk with ``mid_stream``. Later calls go through, as after an outage.
    The writing lease is not counted: the files are the checkpoint's."""

    def __init__(self, inner: Backend, fail_at: int, *, mid_stream: bool = False) -> None:
        super().__init__(inner)
        self.fail_at = fail_at
        self.mid_stream = mid_stream
        self.files = 0
        self.failed: str | None = None

    def _count(self, rel: str) -> bool:
        if layout.is_lease_file(rel.rpartition("/")[2]):
            return False
        self.files += 1
        return self.files == self.fail_at

    def _fail(self, rel: str) -> None:
        self.failed = rel
        raise OSError(5, "injected remote failure", rel)

    @contextmanager
    def open_write(self, rel: str) -> Iterator[WritableFile]:
        doomed = self._count(rel)
        if doomed and not self.mid_stream:
            self._fail(rel)
        with self.inner.open_write(rel) as target:
            yield _FailingFile(target, lambda: self._fail(rel)) if doomed else target

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        if self._count(rel):
            self._fail(rel)
        super().write_bytes(rel, data, exclusive=exclusive)


class _FailingFile:
    def __init__(self, target: WritableFile, fail: Callable[[], None]) -> None:
        self._target = target
        self._fail = fail

    def write(self, data: bytes | bytearray | memoryview, /) -> int | None:
        self._target.write(data[: len(data) // 2])  # some bytes reach the file first
        self._fail()
        return None

    def tell(self) -> int:
        return self._target.tell()


class _Gated(_Wrapped):
    """Holds the first checkpoint's first write until ``release`` is set, and counts how many
    replications (first write of a name to its marker) are in flight at once."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.started = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.active: set[str] = set()
        self.max_active = 0
        self.order: list[str] = []

    def _begin(self, rel: str) -> None:
        name = rel.split("/")[0]
        with self._lock:
            if name not in self.active:
                self.active.add(name)
                self.order.append(name)
                self.max_active = max(self.max_active, len(self.active))
        self.started.set()
        assert self.release.wait(_GATE_TIMEOUT_S), "test gate never released"

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        self._begin(rel)
        return super().open_write(rel)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        self._begin(rel)
        super().write_bytes(rel, data, exclusive=exclusive)
        if rel.endswith(layout.COMMITTED_MARKER):
            with self._lock:
                self.active.discard(rel.split("/")[0])


class _LostReply(_Wrapped):
    """The marker's exclusive create succeeds on the server, but the caller sees
    FileExistsError, as a retry after a lost reply would."""

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        super().write_bytes(rel, data, exclusive=exclusive)
        if exclusive and rel.endswith(layout.COMMITTED_MARKER):
            raise FileExistsError(17, "exists", self.full_path(rel))


# --------------------------------------------------------------------- fixtures


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "local"


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"memory://replicate-{uuid.uuid4().hex}"
    yield root
    FsspecBackend(root).remove_tree("")


@pytest.fixture(params=["memory", "directory"])
def remote_root(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> str:
    """An object-store-like root (marker publish) or a second directory (rename publish)."""
    return memory_root if request.param == "memory" else str(tmp_path / "remote")


def _remote(root: str) -> Backend:
    backend = open_backend(root, fsync=False)
    backend.makedirs("")
    return backend


def _assert_nothing_under(remote: Backend) -> None:
    """No checkpoint, no partial directory, no stray object."""
    assert list(remote.walk_files("")) == []
    assert remote.list_dir("") == []


# --------------------------------------------------------------------- replicate_checkpoint


@pytest.mark.parametrize("chunk_bytes", [7, 8 << 20])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_replica_is_committed_verified_and_loads(
    local: Path, remote_root: str, chunk_bytes: int, compression: str
) -> None:
    state = _save(local, "step_1", 1, compression=compression, thread_count=2)
    remote = _remote(remote_root)

    manifest = replicate_checkpoint(
        open_backend(str(local)), remote, "step_1", chunk_bytes=chunk_bytes
    )

    assert manifest == open_committed(remote, "step_1").manifest
    assert remote.read_bytes("step_1/_COMMITTED") == (local / "step_1/_COMMITTED").read_bytes()
    report = dcp_safe.verify_checkpoint(remote_root, "step_1")
    assert report.items_checked == len(manifest.items) > 0
    assert_state_equal(_load(remote_root, "step_1", state), state)
    local_files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert sorted(f"step_1/{f}" for f in remote.walk_files("step_1")) == local_files
    assert remote.list_dir("") == ["step_1"]  # no partial directory, no temporary file


class _Sizing(_Wrapped):
    """Records the remote's listings and lone size calls."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.listed: list[str] = []
        self.sized: list[str] = []

    def sizes(self, rel: str) -> dict[str, int]:
        self.listed.append(rel)
        return self.inner.sizes(rel)

    def size(self, rel: str) -> int:
        self.sized.append(rel)
        return self.inner.size(rel)


def test_the_upload_is_checked_from_one_listing_per_folder(local: Path, memory_root: str) -> None:
    # A size call per object is a HEAD each on an object store: thousands at thousands of ranks.
    _save(local, "step_1", 1, thread_count=2)
    remote = _Sizing(_remote(memory_root))
    manifest = replicate_checkpoint(open_backend(str(local)), remote, "step_1")
    folders = {f.path.rpartition("/")[0] for f in manifest.files}
    assert len(manifest.files) > len(folders)
    assert sorted(remote.listed) == sorted(f"step_1/{f}" if f else "step_1" for f in folders)
    uploaded = {f"step_1/{f.path}" for f in manifest.files}
    assert [p for p in remote.sized if p in uploaded] == []


def test_a_second_run_is_a_no_op(local: Path, remote_root: str) -> None:
    _save(local, "step_1", 1)
    source = open_backend(str(local))
    first = replicate_checkpoint(source, _remote(remote_root), "step_1")
    recording = _Recording(_remote(remote_root))

    assert replicate_checkpoint(source, recording, "step_1") == first
    assert recording.changes == []


def test_an_uncommitted_local_checkpoint_is_refused(local: Path, memory_root: str) -> None:
    _save(local, "step_1", 1)
    (local / "step_1" / layout.COMMITTED_MARKER).unlink()
    remote = _remote(memory_root)

    with pytest.raises(CheckpointNotFoundError):
        replicate_checkpoint(open_backend(str(local)), remote, "step_1")
    _assert_nothing_under(remote)


def test_a_flipped_local_byte_commits_nothing_remotely(local: Path, remote_root: str) -> None:
    _save(local, "step_1", 1)
    shard = _flip_byte_in_an_item(local, "step_1")
    remote = _remote(remote_root)

    with pytest.raises(CheckpointCorruptError) as info:
        replicate_checkpoint(open_backend(str(local)), remote, "step_1", chunk_bytes=64)
    assert info.value.path.endswith(f"step_1/{shard}")
    assert info.value.item is not None and info.value.item.startswith("f32")
    _assert_nothing_under(remote)


def test_a_damaged_small_file_or_a_truncated_shard_commits_nothing(
    local: Path, memory_root: str
) -> None:
    _save(local, "step_1", 1)
    _save(local, "step_2", 2)
    metadata = local / "step_1" / layout.DCP_METADATA
    data = bytearray(metadata.read_bytes())
    data[-1] ^= 0x01
    metadata.write_bytes(bytes(data))
    shard = next((local / "step_2").glob(f"*{layout.SHARD_SUFFIX}"))
    shard.write_bytes(shard.read_bytes()[:-3])
    source, remote = open_backend(str(local)), _remote(memory_root)

    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        replicate_checkpoint(source, remote, "step_1")
    with pytest.raises(CheckpointCorruptError, match="size differs"):
        replicate_checkpoint(source, remote, "step_2")
    _assert_nothing_under(remote)


# Files in upload order (thread_count=2): two shards, the rank manifest, .metadata, then
# manifest.json and _COMMITTED as small writes.
@pytest.mark.parametrize(
    ("fail_at", "mid_stream", "failed"),
    [
        (1, True, "__0_0.distcp"),
        (2, False, "__0_1.distcp"),
        (3, True, "rank_00000.json"),
        (5, False, layout.MANIFEST),
        (6, False, layout.COMMITTED_MARKER),
    ],
)
def test_a_remote_failure_mid_copy_commits_nothing_and_a_retry_succeeds(
    local: Path, remote_root: str, fail_at: int, mid_stream: bool, failed: str
) -> None:
    state = _save(local, "step_1", 1, thread_count=2)
    local_files = {p: p.read_bytes() for p in (local / "step_1").rglob("*") if p.is_file()}
    faulty = _FailingWrite(_remote(remote_root), fail_at, mid_stream=mid_stream)

    with Replicator(open_backend(str(local)), faulty, chunk_bytes=256) as replicator:
        error = replicator.submit("step_1").exception(timeout=_GATE_TIMEOUT_S)
        assert isinstance(error, OSError) and "injected remote failure" in str(error)
        assert faulty.failed is not None and faulty.failed.endswith(failed)
        _assert_nothing_under(faulty.inner)
        dcp_safe.verify_checkpoint(local, "step_1")  # the local checkpoint is intact
        assert {p: p.read_bytes() for p in local_files} == local_files

        replicator.submit("step_1").result(timeout=_GATE_TIMEOUT_S)  # the fault was one-shot
    assert_state_equal(_load(remote_root, "step_1", state), state)


def test_another_checkpoint_of_that_name_on_the_remote_is_never_replaced(
    tmp_path: Path, local: Path, remote_root: str
) -> None:
    other = _save(tmp_path / "elsewhere", "step_1", 9)
    _save(local, "step_1", 1)
    remote = _remote(remote_root)
    replicate_checkpoint(open_backend(str(tmp_path / "elsewhere")), remote, "step_1")
    recording = _Recording(remote)

    with pytest.raises(CheckpointExistsError):
        replicate_checkpoint(open_backend(str(local)), recording, "step_1")
    assert recording.changes == []
    assert_state_equal(_load(remote_root, "step_1", other), other)


def test_losing_the_race_to_another_manifest_is_refused(
    tmp_path: Path, local: Path, remote_root: str
) -> None:
    """Someone else commits the name between our check and our publish. On an object store
    the lease rules that out unless it was lost (here: collected, as the sweeper would, and
    taken by the other replication) after our last check."""
    other = _save(tmp_path / "elsewhere", "step_1", 9)
    _save(local, "step_1", 1)
    remote = _remote(remote_root)

    class _Racing(_Wrapped):
        def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
            if rel.endswith(layout.COMMITTED_MARKER):
                remote.remove_file(f"step_1/{layout.WRITING_LEASE}")
                replicate_checkpoint(open_backend(str(tmp_path / "elsewhere")), remote, "step_1")
            super().write_bytes(rel, data, exclusive=exclusive)

    with pytest.raises(CheckpointExistsError):
        replicate_checkpoint(open_backend(str(local)), _Racing(remote), "step_1")
    dcp_safe.verify_checkpoint(remote_root, "step_1")
    assert_state_equal(_load(remote_root, "step_1", other), other)
    assert not [e for e in remote.list_dir("") if layout.is_partial_entry(e)]


def test_a_lost_reply_to_our_own_marker_is_success(local: Path, memory_root: str) -> None:
    state = _save(local, "step_1", 1)

    manifest = replicate_checkpoint(
        open_backend(str(local)), _LostReply(_remote(memory_root)), "step_1"
    )

    assert manifest.name == "step_1"
    dcp_safe.verify_checkpoint(memory_root, "step_1")
    assert_state_equal(_load(memory_root, "step_1", state), state)


def test_a_lost_reply_to_our_own_publish_is_success(local: Path, tmp_path: Path) -> None:
    """The rename strategy's equivalent: the rename happened, the caller saw EEXIST."""
    state = _save(local, "step_1", 1)
    remote_root = str(tmp_path / "remote")

    class _LostRename(_Wrapped):
        def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
            super().publish_dir(src, dst, replace=replace)
            raise FileExistsError(17, "exists", dst)

    replicate_checkpoint(open_backend(str(local)), _LostRename(_remote(remote_root)), "step_1")
    dcp_safe.verify_checkpoint(remote_root, "step_1")
    assert_state_equal(_load(remote_root, "step_1", state), state)


# --------------------------------------------------------------------- Replicator


def test_pending_work_coalesces_to_the_newest_name(local: Path, memory_root: str) -> None:
    names = [f"step_{i}" for i in range(1, 6)]
    states = {name: _save(local, name, i) for i, name in enumerate(names)}
    gated = _Gated(_remote(memory_root))
    replicator = Replicator(open_backend(str(local)), gated)

    futures = {names[0]: replicator.submit(names[0])}
    assert gated.started.wait(_GATE_TIMEOUT_S)  # step_1 is running, held at the gate
    futures.update({name: replicator.submit(name) for name in names[1:]})
    gated.release.set()
    replicator.close(timeout_s=_GATE_TIMEOUT_S)

    assert all(future.done() for future in futures.values())  # none orphaned
    assert futures["step_1"].result().name == "step_1"
    assert futures["step_5"].result().name == "step_5"
    for skipped, newer in [("step_2", "step_3"), ("step_3", "step_4"), ("step_4", "step_5")]:
        error = futures[skipped].exception()
        assert isinstance(error, ReplicationSkippedError)
        assert (error.name, error.superseded_by) == (skipped, newer)
        assert newer in str(error)
    assert replicator.skipped == ["step_2", "step_3", "step_4"]
    assert gated.order == ["step_1", "step_5"]
    assert gated.max_active == 1
    assert sorted(gated.list_dir("")) == ["step_1", "step_5"]
    assert_state_equal(_load(memory_root, "step_5", states["step_5"]), states["step_5"])
    assert replicator.future("step_3") is futures["step_3"]
    with pytest.raises(KeyError):
        replicator.future("step_9")


def test_close_is_bounded_and_can_be_retried(local: Path, memory_root: str) -> None:
    _save(local, "step_1", 1)
    gated = _Gated(_remote(memory_root))
    replicator = Replicator(open_backend(str(local)), gated)
    future = replicator.submit("step_1")
    assert gated.started.wait(_GATE_TIMEOUT_S)

    with pytest.raises(ReplicationTimeoutError) as info:
        replicator.close(timeout_s=0.01)  # held at the gate: it cannot drain
    assert isinstance(info.value, TimeoutError) and "step_1" in str(info.value)
    with pytest.raises(dcp_safe.ConfigError):
        replicator.submit("step_2")

    gated.release.set()
    replicator.close(timeout_s=_GATE_TIMEOUT_S)
    assert future.done() and future.result().name == "step_1"
    assert not any(t.name == "dcp_safe-replicator" and t.is_alive() for t in threading.enumerate())


def test_close_reraises_a_failure_nobody_retrieved(local: Path, memory_root: str) -> None:
    _save(local, "step_1", 1)
    remote = _remote(memory_root)
    replicator = Replicator(open_backend(str(local)), remote)
    replicator.submit("step_404")
    replicator.wait(_GATE_TIMEOUT_S)
    replicator.submit("step_1")

    with pytest.raises(CheckpointNotFoundError, match="step_404"):
        replicator.close(timeout_s=_GATE_TIMEOUT_S)
    assert replicator.future("step_1").result(timeout=_GATE_TIMEOUT_S).name == "step_1"
    replicator.close()  # reported once; a second close is quiet


def test_close_does_not_repeat_a_failure_already_retrieved(local: Path, memory_root: str) -> None:
    replicator = Replicator(open_backend(str(local)), _remote(memory_root))
    future: Future[Manifest] = replicator.submit("step_404")
    assert isinstance(future.exception(timeout=_GATE_TIMEOUT_S), CheckpointNotFoundError)
    replicator.close(timeout_s=_GATE_TIMEOUT_S)


def test_a_running_name_resubmitted_shares_its_future(local: Path, memory_root: str) -> None:
    _save(local, "step_1", 1)
    gated = _Gated(_remote(memory_root))
    with Replicator(open_backend(str(local)), gated) as replicator:
        first = replicator.submit("step_1")
        assert gated.started.wait(_GATE_TIMEOUT_S)
        assert replicator.submit("step_1") is first
        gated.release.set()
    assert first.result(timeout=_GATE_TIMEOUT_S).name == "step_1" and replicator.skipped == []


def test_a_replicator_refuses_to_be_pickled(local: Path, memory_root: str) -> None:
    replicator = Replicator(open_backend(str(local)), _remote(memory_root))
    with pytest.raises(TypeError, match="__getstate__"):
        pickle.dumps(replicator)


# --------------------------------------------------------------------- S3 (moto)


@pytest.mark.s3
def test_replicates_to_s3_and_leaves_nothing_behind_on_failure(
    local: Path,
    s3: LocalS3,
    s3_bucket: str,
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    state = _save(local, "step_1", 1, thread_count=2)
    _save(local, "step_2", 2)
    _flip_byte_in_an_item(local, "step_2")
    source = open_backend(str(local))
    remote = open_backend(s3_root, s3_options)
    assert remote.supports_exclusive_create and not remote.supports_atomic_rename

    with Replicator(source, remote) as replicator:
        assert replicator.submit("step_1").result(timeout=_GATE_TIMEOUT_S).name == "step_1"
    dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    assert_state_equal(_load(s3_root, "step_1", state, storage_options=s3_options), state)

    with pytest.raises(CheckpointCorruptError):
        replicate_checkpoint(source, remote, "step_2", chunk_bytes=BLOCK_BYTES)
    prefix = s3_root.removeprefix(f"s3://{s3_bucket}/")
    assert s3.keys(s3_bucket, f"{prefix}/step_2") == []
    assert s3.open_uploads(s3_bucket) == []
    assert [c.name for c in dcp_safe.list_checkpoints(s3_root, storage_options=s3_options)] == [
        "step_1"
    ]
