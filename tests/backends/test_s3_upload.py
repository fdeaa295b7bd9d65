"""The pipelined S3 multipart writer behind FsspecBackend.open_write on s3fs (moto)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from s3_fixtures import BLOCK_BYTES

from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.s3_upload import S3MultipartWriter, block_size_of
from dcp_safe.errors import StorageError
from dcp_safe.testing.s3 import LocalS3

pytestmark = pytest.mark.s3


class _Spy:
    """Counts the S3 calls an s3fs instance makes; can fail one of them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fs: Any) -> None:
        self.calls: list[str] = []
        self.fail_on: tuple[str, int] | None = None  # (method, its nth call)
        real = fs.call_s3

        def call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(method)
            if self.fail_on == (method, self.calls.count(method)):
                raise OSError(5, f"{method} failed (injected)")
            return real(method, *args, **kwargs)

        monkeypatch.setattr(fs, "call_s3", call_s3)


def _part_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dcp-safe-s3-part")]


@pytest.fixture
def backend(s3_bucket: str, s3_options: dict[str, Any]) -> FsspecBackend:
    return FsspecBackend(f"s3://{s3_bucket}/root", s3_options)


def test_block_size_follows_the_file_system(backend: FsspecBackend) -> None:
    assert block_size_of(backend.fs) == BLOCK_BYTES
    with pytest.raises(ValueError, match="below"):
        S3MultipartWriter(backend.fs, "b/k", 2**20)


def test_multi_block_upload_round_trips(
    s3: LocalS3,
    s3_bucket: str,
    backend: FsspecBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch, backend.fs)
    data = bytes(range(256)) * ((3 * BLOCK_BYTES + 12345) // 256)
    with backend.open_write("big") as f:
        assert isinstance(f, S3MultipartWriter)
        for start in range(0, len(data), 3 * 2**20 + 7):  # pieces straddle block edges
            f.write(data[start : start + 3 * 2**20 + 7])
        assert f.tell() == len(data)
        assert not backend.exists("big")
    assert backend.read_bytes("big") == data
    assert spy.calls.count("upload_part") == 4
    assert spy.calls.count("complete_multipart_upload") == 1
    assert "put_object" not in spy.calls
    head = s3.client().head_object(Bucket=s3_bucket, Key="root/big", PartNumber=1)
    assert head["ContentLength"] == BLOCK_BYTES
    assert s3.open_uploads(s3_bucket) == []
    assert _part_threads() == []


def test_exactly_one_block_is_one_part(backend: FsspecBackend) -> None:
    data = b"\x07" * BLOCK_BYTES
    with backend.open_write("one") as f:
        f.write(data)
    assert backend.read_bytes("one") == data


def test_a_small_file_is_one_put(
    s3: LocalS3,
    s3_bucket: str,
    backend: FsspecBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch, backend.fs)
    with backend.open_write("small") as f:
        f.write(b"x" * 1000)
        f.write(b"y" * (BLOCK_BYTES - 1001))
    assert spy.calls == ["put_object"]
    assert backend.read_bytes("small") == b"x" * 1000 + b"y" * (BLOCK_BYTES - 1001)
    assert _part_threads() == []


def test_a_failed_part_mid_stream_aborts_and_leaves_nothing(
    s3: LocalS3,
    s3_bucket: str,
    backend: FsspecBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch, backend.fs)
    spy.fail_on = ("upload_part", 2)
    chunk = b"\xab" * 2**20
    write = backend.open_write("ckpt/shard")
    with pytest.raises(StorageError, match="upload_part failed") as info, write as f:
        for _ in range(6 * BLOCK_BYTES // len(chunk)):
            f.write(chunk)
    assert info.value.path == f"s3://{s3_bucket}/root/ckpt/shard"
    assert "complete_multipart_upload" not in spy.calls
    assert spy.calls.count("abort_multipart_upload") == 1
    assert s3.keys(s3_bucket) == []
    assert s3.open_uploads(s3_bucket) == []
    assert _part_threads() == []


def test_a_failed_last_part_is_raised_at_close_and_aborted(
    s3: LocalS3,
    s3_bucket: str,
    backend: FsspecBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch, backend.fs)
    spy.fail_on = ("upload_part", 2)
    with pytest.raises(StorageError, match="upload_part failed"), backend.open_write("s") as f:
        f.write(b"\x01" * (BLOCK_BYTES + 10))
    assert "complete_multipart_upload" not in spy.calls
    assert s3.keys(s3_bucket) == []
    assert s3.open_uploads(s3_bucket) == []
    assert _part_threads() == []


def test_a_failed_completion_aborts_the_upload(
    s3: LocalS3,
    s3_bucket: str,
    backend: FsspecBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch, backend.fs)
    spy.fail_on = ("complete_multipart_upload", 1)
    with pytest.raises(StorageError) as info, backend.open_write("ckpt/shard") as f:
        f.write(b"\x01" * (2 * BLOCK_BYTES + 10))
    assert info.value.operation == "write"
    assert s3.keys(s3_bucket) == []
    assert s3.open_uploads(s3_bucket) == []


def test_the_callers_buffer_may_change_right_after_write(backend: FsspecBackend) -> None:
    buf = bytearray(2**20)
    expected = bytearray()
    with backend.open_write("reused") as f:
        for i in range(2 * BLOCK_BYTES // len(buf) + 3):
            buf[:] = bytes([i % 251]) * len(buf)
            f.write(memoryview(buf))
            expected += buf
            buf[:] = b"\xff" * len(buf)  # scribbled over at once
    assert backend.read_bytes("reused") == bytes(expected)


def test_parts_carry_crc32_checksums(
    s3: LocalS3,
    s3_bucket: str,
    backend: FsspecBackend,
) -> None:
    with backend.open_write("summed") as f:
        f.write(b"\x02" * (BLOCK_BYTES + 1))
    attrs = s3.client().get_object_attributes(
        Bucket=s3_bucket, Key="root/summed", ObjectAttributes=["Checksum", "ObjectParts"]
    )
    assert "ChecksumCRC32" in attrs.get("Checksum", {})
