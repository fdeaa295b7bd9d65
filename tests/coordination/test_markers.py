"""Polling storage: the one deadline loop, on a fake clock (no wall-clock thresholds)."""

from __future__ import annotations

import pytest
import torch

import dcp_safe
from dcp_safe import SafeStorageWriter
from dcp_safe.backends.roots import open_backend
from dcp_safe.coordination import markers
from dcp_safe.errors import CheckpointExistsError, CheckpointNotFoundError, ReplicationTimeoutError
from dcp_safe.replication.rank_upload import UploadOptions


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(markers, "time", fake)  # this module's clock only, not the process's
    return fake


def test_poll_returns_what_check_finds(clock: _Clock) -> None:
    answers = iter([None, None, "found"])
    assert markers.poll(lambda: next(answers), 10.0) == "found"
    assert clock.pauses == [0.005, 0.01]


def test_poll_backs_off_to_its_longest_pause_and_stops_at_the_deadline(clock: _Clock) -> None:
    calls: list[float] = []

    def never() -> None:
        calls.append(clock.now)

    assert markers.poll(never, 1.0) is None
    assert max(clock.pauses) == 0.25
    assert clock.now == pytest.approx(1.0)  # the last pause is cut to the deadline
    assert calls[-1] == pytest.approx(1.0)  # and checked once more there


def test_poll_checks_once_even_with_no_time_left(clock: _Clock) -> None:
    calls: list[int] = []
    assert markers.poll(lambda: calls.append(1), 0.0) is None
    assert calls == [1] and clock.pauses == []


def test_a_check_that_raises_ends_the_wait(clock: _Clock) -> None:
    def failed() -> None:
        raise OSError("a peer's failure marker")

    with pytest.raises(OSError, match="failure marker"):
        markers.poll(failed, 10.0)


def test_upload_options_poll_raises_a_timeout_naming_what_it_waited_for(clock: _Clock) -> None:
    options = UploadOptions(remote_timeout_s=2, poll_s=0.5)
    with pytest.raises(ReplicationTimeoutError, match=r"gave up after 2 s waiting for the lease"):
        options.poll(lambda: None, "the lease")
    assert set(clock.pauses) == {0.5}


def test_await_committed_refuses_another_saves_commit_and_chains_why_it_timed_out(
    memory_root: str,
) -> None:
    dcp_safe.save(
        {"w": torch.arange(4.0)},
        checkpoint_id="step_1",
        storage_writer=SafeStorageWriter(memory_root),
    )
    backend = open_backend(memory_root)
    assert markers.await_committed(backend, "step_1", timeout_s=5, pause_s=0.01).name == "step_1"
    with pytest.raises(CheckpointExistsError, match="another save committed it"):
        markers.await_committed(backend, "step_1", timeout_s=5, pause_s=0.01, save_id="b" * 32)
    with pytest.raises(ReplicationTimeoutError, match="step_2 was not committed within") as seen:
        markers.await_committed(backend, "step_2", timeout_s=0.05, pause_s=0.01)
    assert isinstance(seen.value.__cause__, CheckpointNotFoundError)


def test_a_watch_whose_storage_fails_in_an_unexpected_way_fails_its_future(
    memory_root: str,
) -> None:
    # Only a timeout used to reach the future: any other error ended the watching thread and
    # left the future pending forever, and the writer waiting on it hung.
    class Broken:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError("the backend's client went away")

    future = markers.watch_for_commit(Broken(), "step_1", poll_s=0.01, timeout_s=5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="client went away"):
        future.result(timeout=30)
