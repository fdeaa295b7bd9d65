"""The save cadence: ``every``, ``interval_s``, ``continuous``, ``first_step``.

The schedule (:func:`~dcp_safe.manager.cadence.due`) is tested as the pure function it is, with
hand-made votes of several ranks whose clocks disagree; the manager's use of it with real saves
and a test clock advanced by the test (no wall-clock time anywhere). The same cadences under
real gloo groups with skewed clocks: ``test_cadence_multirank.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from support.clocks import SkewedClock
from support.faults import GatedWriter

from dcp_safe import CheckpointManager, ConfigError, Runtime, SavePolicy
from dcp_safe.coordination.agreement import Agreement, Vote
from dcp_safe.manager.cadence import Cadence, Reading, due


def _votes(*readings: Reading | None, step: int = 10, busy: tuple[int, ...] = ()) -> list[Vote]:
    return [
        Vote("maybe_save", step, busy=r in busy, detail=reading)
        for r, reading in enumerate(readings)
    ]


# -- the pure schedule -------------------------------------------------------------------------


def test_every_alone_saves_the_multiples_without_a_vote() -> None:
    policy = SavePolicy(every=3)
    assert [s for s in range(1, 10) if due(policy, s, s == 1, [])] == [3, 6, 9]


def test_first_step_saves_the_first_call_whatever_every_says() -> None:
    policy = SavePolicy(every=100, first_step=True)
    assert due(policy, 1, True, []) == "first_step=True"
    assert due(policy, 1, False, []) is None
    assert due(policy, 5001, True, []) == "first_step=True"  # the first call after a resume


def test_interval_reads_the_coordinators_clock_whatever_the_others_say() -> None:
    policy = SavePolicy(interval_s=60)
    # Rank 1's clock runs far ahead, rank 2's stands still: neither moves the decision.
    assert due(policy, 10, False, _votes(Reading(59.9), Reading(1e6), Reading(0.0))) is None
    reason = due(policy, 10, False, _votes(Reading(60.0), Reading(0.0), Reading(-5.0)))
    assert reason == "60.0 s since the last commit >= interval_s"


def test_a_save_in_flight_on_any_rank_is_never_due() -> None:
    for policy in (SavePolicy(interval_s=1), SavePolicy(continuous=True)):
        votes = _votes(Reading(1e9, 1e9), Reading(1e9, 1e9), busy=(1,))
        assert due(policy, 10, False, votes) is None


def test_every_narrows_the_steps_a_timed_cadence_looks_at() -> None:
    for policy in (SavePolicy(every=5, interval_s=1), SavePolicy(every=5, continuous=True)):
        assert due(policy, 12, False, _votes(Reading(1e9, 1e9), step=12)) is None
        assert due(policy, 15, False, _votes(Reading(1e9, 1e9), step=15)) is not None


def test_continuous_saves_once_the_last_committed_and_not_before_its_minimum() -> None:
    policy = SavePolicy(continuous=True, min_interval_s=30)
    assert due(policy, 1, True, _votes(Reading(0.0, None))) is not None  # none started yet
    assert due(policy, 9, False, _votes(Reading(0.0, 29.0), Reading(0.0, 500.0))) is None
    assert due(policy, 9, False, _votes(Reading(0.0, 30.0), Reading(0.0, 1.0))) is not None
    assert due(SavePolicy(continuous=True), 9, False, _votes(Reading(0.0, 0.0))) is not None


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SavePolicy(interval_s=0), "interval_s"),
        (lambda: SavePolicy(interval_s=float("inf")), "interval_s"),
        (lambda: SavePolicy(interval_s="60"), "interval_s"),
        (lambda: SavePolicy(interval_s=60, continuous=True), "interval_s"),
        (lambda: SavePolicy(min_interval_s=5), "min_interval_s"),
        (lambda: SavePolicy(continuous=True, min_interval_s=-1), "min_interval_s"),
        (lambda: SavePolicy(continuous=1), "continuous"),
        (lambda: SavePolicy(first_step="yes"), "first_step"),
    ],
)
def test_a_cadence_out_of_range_names_its_field(build: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        build()


# -- one rank's side: its clock, read once per vote --------------------------------------------


def test_a_cadence_reads_its_clock_once_per_vote_and_restarts_at_a_commit() -> None:
    clock = SkewedClock(start=1e6)
    cadence = Cadence(SavePolicy(interval_s=10), clock, Agreement())
    saved = []
    for step in range(1, 31):
        clock.advance(1.0)
        if cadence.due(step):
            saved.append(step)
            clock.advance(2.0)  # the save takes 2 s to commit
            done: Any = _resolved()
            cadence.committed(done)
    assert saved == [10, 20, 30]  # 10 s after the start, then 10 s after each commit
    assert clock.reads == 1 + 30 + 3 * 2  # built, one per vote, a start and a commit per save


def _resolved() -> Any:
    from concurrent.futures import Future

    done: Future[str] = Future()
    done.set_result("name")
    return done


# -- the manager, real saves -------------------------------------------------------------------


def test_first_step_saves_step_one(tmp_path: Path) -> None:
    policy = SavePolicy(every=100, first_step=True)
    state = {"w": torch.ones(4)}
    with CheckpointManager(tmp_path, policy=policy) as manager:
        handle = manager.maybe_save(1, state)
        assert handle is not None and handle.committed.result(timeout=120) == "step_000000001"
        assert [manager.maybe_save(s, state) for s in range(2, 100)] == [None] * 98
        assert manager.maybe_save(100, state) is not None
    assert manager.stats().committed == 2


def test_interval_saves_by_the_injected_clock_and_restarts_at_each_commit(tmp_path: Path) -> None:
    clock, gate = SkewedClock(), threading.Event()
    policy = SavePolicy(interval_s=10)
    runtime = Runtime(writer=GatedWriter(tmp_path, gate), clock=clock)
    saved = []
    with CheckpointManager(tmp_path, policy=policy, runtime=runtime) as manager:
        for step in range(1, 41):
            clock.advance(1.0)
            handle = manager.maybe_save(step, {"w": torch.full((4,), float(step))})
            if handle is not None:
                saved.append(step)
                clock.advance(3.0)  # it commits 3 s after it began, by the manager's clock
                gate.set()
                handle.committed.result(timeout=120)
                manager.wait(timeout_s=120)  # its follow-up done: the slot is free again
                gate.clear()
    # 10 s after the start, then 10 s after each commit (counted from each start: 17, 24...).
    assert saved == [10, 20, 30, 40]
    assert [e["step"] for e in manager.history() if e["event"] == "committed"] == saved
    assert manager.stats().skipped == 0


def test_a_direct_save_restarts_the_interval(tmp_path: Path) -> None:
    clock = SkewedClock()
    state = {"w": torch.ones(4)}
    policy = SavePolicy(interval_s=10)
    with CheckpointManager(tmp_path, policy=policy, runtime=Runtime(clock=clock)) as manager:
        clock.advance(8.0)
        manager.save(8, state).committed.result(timeout=120)  # type: ignore[union-attr]
        manager.wait(timeout_s=120)
        clock.advance(9.0)
        assert manager.maybe_save(17, state) is None  # 9 s since that commit
        clock.advance(1.0)
        assert manager.maybe_save(18, state) is not None


def test_continuous_waits_for_the_commit_without_requesting_a_save(tmp_path: Path) -> None:
    gate = threading.Event()
    clock = SkewedClock()
    policy = SavePolicy(continuous=True, min_interval_s=5, when_busy="wait")
    runtime = Runtime(writer=GatedWriter(tmp_path, gate), clock=clock)
    state = {"w": torch.ones(4)}
    with CheckpointManager(tmp_path, policy=policy, runtime=runtime) as manager:
        first = manager.maybe_save(1, state)
        assert first is not None
        for step in range(2, 10):  # in flight: not due, not a request (when_busy="wait"
            clock.advance(10.0)  # would block here, "skip" would count a skip at each step)
            assert manager.maybe_save(step, state) is None
        gate.set()
        first.committed.result(timeout=120)
        manager.wait(timeout_s=120)
        assert manager.maybe_save(10, state) is not None  # at once: 80 s since it began
        manager.wait(timeout_s=120)
        clock.advance(4.0)
        assert manager.maybe_save(11, state) is None  # 4 s after the last began
        clock.advance(1.0)
        assert manager.maybe_save(12, state) is not None
    stats = manager.stats()
    assert (stats.requested, stats.skipped, stats.committed) == (3, 0, 3)
