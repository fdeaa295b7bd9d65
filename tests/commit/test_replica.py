"""``ReplicaPublication``: a replica's commit, the same calls whatever kind of root the remote is.

The source is a real checkpoint saved on a local root; the remote is a renaming root (a local
directory) or a marker root (``memory://``, in place behind the writing lease of the
checkpoint's own save id).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import make_state

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.lease import Claimant, holds_lease, lease_files
from dcp_safe.commit.replica import ReplicaPublication, committed_with
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import CheckpointExistsError
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.replication.copying import CheckpointCopy, open_source

NAME = "step_1"


@pytest.fixture
def source(tmp_path: Path) -> tuple[Backend, Manifest, bytes]:
    local = tmp_path / "local"
    writer = SafeStorageWriter(local, options=WriterOptions(thread_count=2))
    dcp_safe.save(make_state(1), checkpoint_id=NAME, storage_writer=writer)
    backend = open_backend(str(local))
    manifest, raw = open_source(backend, NAME)
    return backend, manifest, raw


@pytest.fixture(params=["rename", "marker"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> Backend:
    return open_backend(str(tmp_path / "remote") if request.param == "rename" else memory_root)


def _replica(remote: Backend, manifest: Manifest, raw: bytes) -> ReplicaPublication:
    strategy = strategy_for(remote)
    work_dir = strategy.work_dir(NAME, layout.new_save_id())
    return strategy.replica(remote, manifest, manifest_digest(raw), work_dir, Claimant())


def test_a_replica_is_claimed_uploaded_and_published_the_same_way_on_every_root(
    source: tuple[Backend, Manifest, bytes], remote: Backend
) -> None:
    local, manifest, raw = source
    replica = _replica(remote, manifest, raw)
    assert replica.claim()
    copy = CheckpointCopy(
        local, remote, NAME, manifest, raw, chunk_bytes=1 << 20, before_each=replica.check
    )
    replica.publish(lambda: copy.upload_to(replica.work_dir), copy.uploaded)
    assert committed_with(remote, NAME, manifest_digest(raw))
    assert remote.read_bytes(f"{NAME}/{layout.MANIFEST}") == raw  # the source's, byte for byte
    assert lease_files(remote, NAME) == []
    assert not any(layout.is_partial_entry(e) for e in remote.list_dir(""))
    dcp_safe.verify_checkpoint(remote.url, NAME)


def test_a_failed_upload_publishes_nothing_and_leaves_nothing_of_the_save(
    source: tuple[Backend, Manifest, bytes], remote: Backend
) -> None:
    local, manifest, raw = source
    replica = _replica(remote, manifest, raw)
    replica.claim()
    copy = CheckpointCopy(
        local, remote, NAME, manifest, raw, chunk_bytes=1 << 20, before_each=replica.check
    )

    def upload_then_fail() -> None:
        copy.copy_files(replica.work_dir, manifest.files[:1])
        raise OSError("the connection dropped")

    with pytest.raises(OSError, match="dropped"):
        replica.publish(upload_then_fail, copy.uploaded)
    assert not committed_with(remote, NAME, manifest_digest(raw))
    assert list(remote.walk_files("")) == []


def test_the_publisher_abandons_every_object_of_the_save_and_then_its_lease(
    source: tuple[Backend, Manifest, bytes], memory_root: str
) -> None:
    _, manifest, raw = source
    remote = open_backend(memory_root)
    publisher = _replica(remote, manifest, raw)
    assert publisher.held() is None  # a waiting rank sees no claim yet
    publisher.claim()
    assert publisher.held() is True
    # Every rank uploaded its part (rank 1's objects are not in the publisher's own list).
    for record in manifest.files:
        remote.write_bytes(f"{NAME}/{record.path}", b"part")
    publisher.abandon([f"{NAME}/{manifest.files[0].path}"])
    assert list(remote.walk_files("")) == []


def test_another_rank_removes_only_its_own_part_and_a_joined_replica_leaves_the_rest(
    source: tuple[Backend, Manifest, bytes], memory_root: str
) -> None:
    _, manifest, raw = source
    remote = open_backend(memory_root)
    publisher = _replica(remote, manifest, raw)
    publisher.claim()
    first, second = (f"{NAME}/{r.path}" for r in manifest.files[:2])
    remote.write_bytes(first, b"rank 0")
    remote.write_bytes(second, b"rank 1")
    joined = _replica(remote, manifest, raw)
    assert joined.claim()  # the same checkpoint's save id: the lease is shared
    joined.remove_part([second])
    joined.abandon([first])  # it joined the lease: the holder cleans up, not it
    assert remote.exists(first) and not remote.exists(second)
    assert holds_lease(remote, NAME, manifest.save_id)


def test_committed_with_tells_ours_from_another_checkpoint_and_from_a_damaged_one(
    source: tuple[Backend, Manifest, bytes], memory_root: str
) -> None:
    _, manifest, raw = source
    remote = open_backend(memory_root)
    digest = manifest_digest(raw)
    assert not committed_with(remote, NAME, digest)
    remote.write_bytes(f"{NAME}/{layout.MANIFEST}", raw)
    remote.write_bytes(f"{NAME}/{layout.COMMITTED_MARKER}", digest.encode())
    assert committed_with(remote, NAME, digest)
    assert _replica(remote, manifest, raw).claim() is False  # nothing left to do
    with pytest.raises(CheckpointExistsError):
        committed_with(remote, NAME, "another-digest")
    remote.write_bytes(f"{NAME}/{layout.MANIFEST}", raw + b" ")
    with pytest.raises(CheckpointCorruptError):
        committed_with(remote, NAME, digest)
