"""A synchronous save or load pauses the cyclic collector and leaves it as it found it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter
from dcp_safe.adapters.api import gc_paused
from dcp_safe.errors import DcpSafeError


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_paused_inside_and_running_after() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_resume_when_the_last_one_ends() -> None:
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with gc_paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's save still runs
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_save_runs_with_the_collector_paused_and_restores_it(tmp_path: Path) -> None:
    seen: list[bool] = []

    class Probe(SafeStorageWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().write_data(plan, planner)

    gc.enable()
    dcp_safe.save({"w": torch.ones(4)}, storage_writer=Probe(tmp_path), checkpoint_id="a")
    assert seen == [False]
    assert gc.isenabled()


def test_a_failed_save_restores_the_collector(tmp_path: Path) -> None:
    class Failing(SafeStorageWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            raise OSError("disk gone")

    gc.enable()
    with pytest.raises(DcpSafeError):
        dcp_safe.save({"w": torch.ones(4)}, storage_writer=Failing(tmp_path), checkpoint_id="a")
    assert gc.isenabled()


def test_a_load_runs_with_the_collector_paused_and_restores_it(tmp_path: Path) -> None:
    seen: list[bool] = []

    class Probe(SafeStorageReader):
        def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().read_data(plan, planner)

    dcp_safe.save(
        {"w": torch.ones(4)}, storage_writer=SafeStorageWriter(tmp_path), checkpoint_id="a"
    )
    gc.enable()
    back = {"w": torch.zeros(4)}
    dcp_safe.load(back, storage_reader=Probe(tmp_path), checkpoint_id="a")
    assert seen == [False]
    assert gc.isenabled()
    assert torch.equal(back["w"], torch.ones(4))
