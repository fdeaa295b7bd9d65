"""The backend contract, run against every backend dcp_safe ships."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from s3_fixtures import BLOCK_BYTES

from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.errors import CheckpointCorruptError, StorageError
from dcp_safe.testing.backend_contract import BackendContract
from dcp_safe.testing.s3 import LocalS3


class TestLocalBackend(BackendContract):
    # POSIX files are visible while written; the writer works in a hidden partial directory.
    hides_open_writes = False

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(str(tmp_path / "root"), fsync=False)

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        (tmp_path / "root").mkdir()


class TestMemoryBackend(BackendContract):
    def make_backend(self) -> Backend:
        return FsspecBackend(f"memory://contract-{uuid.uuid4().hex}")


@pytest.mark.s3
class TestS3Backend(BackendContract):
    large_write_bytes = 2 * BLOCK_BYTES + 2**20  # three multipart parts

    @pytest.fixture
    def backend(self, s3_bucket: str, s3_options: dict[str, Any]) -> Backend:
        return FsspecBackend(f"s3://{s3_bucket}/root", s3_options)

    @pytest.fixture(autouse=True)
    def _server(self, s3: LocalS3, s3_bucket: str) -> None:
        self._s3, self._bucket = s3, s3_bucket

    def assert_no_pending_uploads(self, backend: Backend) -> None:
        assert self._s3.open_uploads(self._bucket) == []

    def test_s3_claims_conditional_create(self, backend: Backend) -> None:
        assert backend.supports_exclusive_create
        assert not backend.supports_atomic_rename


@pytest.mark.s3
class TestS3BucketRoot(BackendContract):
    """A root that is a whole bucket: removing a tree must never remove the bucket."""

    @pytest.fixture
    def backend(self, s3_bucket: str, s3_options: dict[str, Any]) -> Backend:
        return FsspecBackend(f"s3://{s3_bucket}", s3_options)


@pytest.mark.s3
def test_s3_failure_to_complete_aborts_the_upload_and_names_the_url(
    s3: LocalS3,
    s3_bucket: str,
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = FsspecBackend(f"s3://{s3_bucket}/root", s3_options)
    call_s3 = backend.fs.call_s3

    def fail_completion(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "complete_multipart_upload":
            raise OSError(5, "CompleteMultipartUpload failed (injected)")
        return call_s3(method, *args, **kwargs)

    monkeypatch.setattr(backend.fs, "call_s3", fail_completion)
    with pytest.raises(StorageError) as info, backend.open_write("ckpt/shard") as f:
        f.write(b"\x01" * (2 * BLOCK_BYTES + 10))
    assert info.value.operation == "write"
    assert info.value.path == f"s3://{s3_bucket}/root/ckpt/shard"
    assert s3.keys(s3_bucket) == []
    assert s3.open_uploads(s3_bucket) == []


@pytest.mark.s3
def test_s3_errors_name_the_operation_and_url(s3_options: dict[str, Any]) -> None:
    backend = FsspecBackend("s3://no-such-bucket-dcp-safe/root", s3_options)
    with pytest.raises(StorageError, match=r"write failed for s3://no-such-bucket-dcp-safe/root/m"):
        backend.write_bytes("m", b"x", exclusive=True)
    shard = r"s3://no-such-bucket-dcp-safe/root/shard"
    with pytest.raises(StorageError, match=shard), backend.open_write("shard") as f:
        f.write(b"x")


def _count_s3_requests(backend: FsspecBackend) -> list[str]:
    """The S3 operations the backend's client sends from now on, by name, in order."""
    sent: list[str] = []
    client = backend.fs.s3  # s3fs's aiobotocore client, made on first use (the bucket exists)

    def record(model: Any, **_: Any) -> None:
        sent.append(model.name)

    client.meta.events.register("before-call.s3", record)
    return sent


@pytest.mark.s3
def test_s3_read_small_is_one_ranged_get(s3_bucket: str, s3_options: dict[str, Any]) -> None:
    backend = FsspecBackend(f"s3://{s3_bucket}/root", s3_options)
    backend.write_bytes("d/f", b"x" * 100)
    sent = _count_s3_requests(backend)
    assert backend.read_small("d/f", 100) == b"x" * 100
    assert sent == ["GetObject"]
    with pytest.raises(CheckpointCorruptError, match="over the 99-byte limit"):
        backend.read_small("d/f", 99)
    assert sent == ["GetObject", "GetObject"]


@pytest.mark.s3
def test_s3_sizes_is_one_listing_per_thousand_keys_and_sees_new_keys_through_a_cache(
    s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    # A caller's listing cache must not hide a shard another rank wrote after a listing.
    backend = FsspecBackend(f"s3://{s3_bucket}/root", {**s3_options, "use_listings_cache": True})
    for i in range(3):
        backend.write_bytes(f"w/__{i}_0.distcp", b"x" * i)
    backend.write_bytes("w/_ranks/rank_00000.json", b"{}")
    sent = _count_s3_requests(backend)
    assert backend.sizes("w") == {f"__{i}_0.distcp": i for i in range(3)}
    assert sent == ["ListObjectsV2"]
    backend.write_bytes("w/__3_0.distcp", b"xyz")
    assert backend.sizes("w")["__3_0.distcp"] == 3
