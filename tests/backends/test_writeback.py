"""Early writeback: a durable local file asks the kernel to write back each few MiB as it goes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dcp_safe.backends import local_backend as writeback
from dcp_safe.backends.local_backend import LocalBackend, WritebackFile

STEP = 64 << 10


class _Recorder:
    """Stands in for ``sync_file_range``: records each request, then makes the real call."""

    def __init__(self, result: int | None = None) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.result = result

    def __call__(self, fd: int, offset: int, length: int, flags: int) -> int:
        self.calls.append((fd, offset, length, flags))
        # The bytes asked for are in the page cache already: the buffer was flushed first.
        assert os.fstat(fd).st_size >= offset + length
        if self.result is not None:
            return self.result
        real = writeback._load()
        return 0 if real is None else real(fd, offset, length, flags)


def test_linux_has_it() -> None:
    if sys.platform == "linux":
        assert writeback._sync_file_range is not None


def test_writeback_is_requested_for_each_step_in_order_and_the_bytes_are_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(writeback, "_sync_file_range", recorder)
    pieces = [os.urandom(STEP // 3 + i) for i in range(12)]
    with open(tmp_path / "f", "xb") as raw:
        out = WritebackFile(raw, step=STEP)
        for piece in pieces:
            assert out.write(piece) == len(piece)
        assert out.tell() == sum(map(len, pieces))
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    offsets = [offset for _, offset, _, _ in recorder.calls]
    ends = [offset + length for _, offset, length, _ in recorder.calls]
    assert offsets == [0, *ends[:-1]]  # contiguous, from the start of the file
    assert all(length >= STEP for _, _, length, _ in recorder.calls)
    assert len(recorder.calls) == sum(map(len, pieces)) // STEP
    assert {flags for *_, flags in recorder.calls} == {2}  # SYNC_FILE_RANGE_WRITE, never WAIT


def test_a_refusal_turns_it_off_for_that_file_and_the_write_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder(result=-1)
    monkeypatch.setattr(writeback, "_sync_file_range", recorder)
    with open(tmp_path / "f", "xb") as raw:
        out = WritebackFile(raw, step=STEP)
        for _ in range(5):
            out.write(b"x" * STEP)
    assert len(recorder.calls) == 1
    assert (tmp_path / "f").stat().st_size == 5 * STEP


def test_without_the_call_files_are_written_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writeback, "_sync_file_range", None)
    with open(tmp_path / "f", "xb") as raw:
        out = WritebackFile(raw, step=STEP)
        out.write(b"y" * (3 * STEP))
    assert (tmp_path / "f").read_bytes() == b"y" * (3 * STEP)


@pytest.mark.parametrize("fsync", [True, False])
def test_the_local_backend_starts_writeback_only_for_durable_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(writeback, "_sync_file_range", recorder)
    backend = LocalBackend(str(tmp_path), fsync=fsync)
    data = os.urandom(3 * writeback.WRITEBACK_STEP_BYTES)
    with backend.open_write("shard") as f:
        f.write(data)
        assert f.tell() == len(data)
    assert backend.read_bytes("shard") == data
    assert len(recorder.calls) == (1 if fsync else 0)
