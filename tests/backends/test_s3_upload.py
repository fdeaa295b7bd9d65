"""The pipelined S3 multipart writer behind FsspecBackend.open_write on s3fs (moto)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from s3_fixtures import BLOCK_BYTES

from dcp_safe.backends.fsspec_backend import FsspecBackend, write_buffer_bytes
from dcp_safe.backends.roots import open_backend
from dcp_safe.backends.s3_upload import (
    DEFAULT_PARTS_IN_FLIGHT,
    MIN_PART_BYTES,
    S3MultipartWriter,
    block_size_of,
    upload_buffer_bytes,
)
from dcp_safe.errors import ConfigError, StorageError
from dcp_safe.testing.s3 import LocalS3

pytestmark = pytest.mark.s3


class _Spy:
    """Counts the S3 calls an s3fs instance makes (from any thread); can fail one of them, and
    calls ``before_part`` and ``after_part`` with the number of each ``upload_part`` around the
    real request (to hold it, or to note its reply)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fs: Any) -> None:
        self.calls: list[str] = []
        self.fail_on: tuple[str, int] | None = None  # (method, its nth call)
        self.before_part: Callable[[int], None] | None = None
        self.after_part: Callable[[int], None] | None = None
        self.finished_parts: list[int] = []  # in the order their replies arrived
        self.parts_in_flight = 0
        self.most_parts_in_flight = 0
        self._lock = threading.Lock()
        real = fs.call_s3

        def call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls.append(method)
                fail = self.fail_on == (method, self.calls.count(method))
            if method != "upload_part":
                if fail:
                    raise OSError(5, f"{method} failed (injected)")
                return real(method, *args, **kwargs)
            with self._lock:
                self.parts_in_flight += 1
                self.most_parts_in_flight = max(self.most_parts_in_flight, self.parts_in_flight)
            try:
                if self.before_part is not None:
                    self.before_part(kwargs["PartNumber"])
                if fail:
                    raise OSError(5, f"{method} failed (injected)")
                out = real(method, *args, **kwargs)
                with self._lock:
                    self.finished_parts.append(kwargs["PartNumber"])
                if self.after_part is not None:
                    self.after_part(kwargs["PartNumber"])
                return out
            finally:
                with self._lock:
                    self.parts_in_flight -= 1

        monkeypatch.setattr(fs, "call_s3", call_s3)


def _part_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dcp-safe-s3-part")]


@pytest.fixture
def backend(s3_bucket: str, s3_options: dict[str, Any]) -> FsspecBackend:
    return FsspecBackend(f"s3://{s3_bucket}/root", s3_options)


def test_block_size_follows_the_file_system(backend: FsspecBackend) -> None:
    assert block_size_of(backend.fs) == BLOCK_BYTES
    # Never below S3's smallest part, whatever the file system says.
    assert block_size_of(SimpleNamespace(default_block_size=2**20)) == MIN_PART_BYTES


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


# ---------------------------------------------------------------- several parts in flight

# A guard against a hang if the writer sent fewer parts at once than the test waits for; the
# tests never depend on how long anything takes.
_HANG_GUARD_S = 60.0


def _backend_with(s3_bucket: str, s3_options: dict[str, Any], parts: int) -> FsspecBackend:
    return FsspecBackend(f"s3://{s3_bucket}/root", {**s3_options, "max_concurrency": parts})


def test_parts_in_flight_default_bound_and_budget_figure(
    s3_bucket: str, s3_options: dict[str, Any], backend: FsspecBackend
) -> None:
    assert DEFAULT_PARTS_IN_FLIGHT == 4
    assert write_buffer_bytes(backend) == 5 * BLOCK_BYTES  # 4 in flight + 1 filling
    assert write_buffer_bytes(_backend_with(s3_bucket, s3_options, 2)) == 3 * BLOCK_BYTES
    wrapped = open_backend(f"s3://{s3_bucket}/root", {**s3_options, "max_concurrency": 3})
    assert write_buffer_bytes(wrapped) == 4 * BLOCK_BYTES  # seen through RetryingBackend
    assert write_buffer_bytes(FsspecBackend("memory://x")) == 0  # the store is the buffer
    assert write_buffer_bytes(open_backend("/tmp")) == 0


# (0 and -1 s3fs refuses itself, before dcp_safe reads the option.)
@pytest.mark.parametrize("bad", [True, 2.0])
def test_a_bad_parts_in_flight_is_refused(
    s3_bucket: str, s3_options: dict[str, Any], bad: object
) -> None:
    with pytest.raises(ConfigError, match="max_concurrency"):
        _backend_with(s3_bucket, s3_options, bad)  # type: ignore[arg-type]


def test_a_bad_max_concurrency_option_is_refused_at_open(
    s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match="got True"):
        FsspecBackend(f"s3://{s3_bucket}/root", {**s3_options, "max_concurrency": True})


def test_several_parts_are_in_flight_at_once_never_more_than_the_bound(
    s3: LocalS3,
    s3_bucket: str,
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = _backend_with(s3_bucket, s3_options, 3)
    spy = _Spy(monkeypatch, backend.fs)
    # The first three parts are each held until all three have been sent: with fewer in
    # flight at once the barrier breaks and the upload fails.
    together = threading.Barrier(3, timeout=_HANG_GUARD_S)

    def hold(number: int) -> None:
        if number <= 3:
            together.wait()

    spy.before_part = hold
    data = bytes(range(256)) * ((7 * BLOCK_BYTES + 999) // 256)
    with backend.open_write("wide") as f:
        assert isinstance(f, S3MultipartWriter)
        for start in range(0, len(data), 2**20):
            f.write(data[start : start + 2**20])
        writer = f
    assert backend.read_bytes("wide") == data
    assert spy.most_parts_in_flight == 3
    assert spy.calls.count("upload_part") == 8
    assert 0 < writer.peak_buffer_bytes <= upload_buffer_bytes(BLOCK_BYTES, 3) == 4 * BLOCK_BYTES
    assert s3.open_uploads(s3_bucket) == []
    assert _part_threads() == []


def test_parts_finishing_out_of_order_complete_in_order(
    s3_bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend_with(s3_bucket, s3_options, 3)
    spy = _Spy(monkeypatch, backend.fs)
    third_done = threading.Event()

    def hold(number: int) -> None:
        if number == 1:  # the first part is sent only once the third has been answered
            assert third_done.wait(_HANG_GUARD_S), "part 3 was never sent beside part 1"

    def answered(number: int) -> None:
        if number == 3:
            third_done.set()

    spy.before_part, spy.after_part = hold, answered
    data = b"".join(bytes([i]) * BLOCK_BYTES for i in range(3)) + b"tail"
    with backend.open_write("shuffled") as f:
        f.write(data)
    assert spy.finished_parts.index(1) > spy.finished_parts.index(3)
    assert backend.read_bytes("shuffled") == data


def test_a_failed_part_beside_others_in_flight_aborts_after_they_finish(
    s3: LocalS3,
    s3_bucket: str,
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = _backend_with(s3_bucket, s3_options, 3)
    spy = _Spy(monkeypatch, backend.fs)
    spy.fail_on = ("upload_part", 2)
    together = threading.Barrier(3, timeout=_HANG_GUARD_S)

    def hold(number: int) -> None:
        if number <= 3:  # parts 1 and 3 are being sent when part 2 fails
            together.wait()

    spy.before_part = hold
    write = backend.open_write("ckpt/shard")
    with pytest.raises(StorageError, match="part 2") as info, write as f:
        for _ in range(6):
            f.write(b"\xcd" * BLOCK_BYTES)
    assert info.value.path == f"s3://{s3_bucket}/root/ckpt/shard"
    assert spy.calls[-1] == "abort_multipart_upload"  # no part was sent after the abort
    assert spy.parts_in_flight == 0
    assert "complete_multipart_upload" not in spy.calls
    assert s3.keys(s3_bucket) == []
    assert s3.open_uploads(s3_bucket) == []
    assert _part_threads() == []
