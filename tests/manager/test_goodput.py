"""The goodput controller: Young-Daly's interval from measured costs, the MTBF from the history,
the expected work lost per hour checked against a simulated run with injected failures.

The arithmetic is tested as the pure functions it is; the manager's use of it with real saves
(thread executor, local root) and a test clock the test advances: the costs are then exactly
what the test's schedule implies, and no wall-clock time is measured.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.clocks import SkewedClock
from support.faults import GatedWriter

from dcp_safe import CheckpointManager, ConfigError, Runtime, SavePolicy
from dcp_safe.coordination.agreement import Vote
from dcp_safe.layout import HISTORY_FILE
from dcp_safe.manager.cadence import (
    LONGEST_S,
    PRIOR_MTBF_S,
    Costs,
    Goodput,
    Reading,
    agree,
    choose,
    due,
    estimate_mtbf,
    loss_per_hour_s,
    young_daly_s,
)
from dcp_safe.telemetry import EventKind, PrometheusSink, Telemetry

_GATE_TIMEOUT_S = 120  # a safety net against a hang, never an assertion
_DAY_S = 86400.0


# -- the arithmetic ----------------------------------------------------------------------------


def test_young_daly_minimises_the_time_lost_per_second() -> None:
    cost, commit, mtbf = 30.0, 120.0, _DAY_S
    chosen = choose(Costs(stall_s=cost, commit_s=commit, mtbf_s=mtbf, mtbf_note="given"))
    assert chosen.save_interval_s == pytest.approx(young_daly_s(cost, mtbf))

    def lost(t: float) -> float:  # saving overhead plus expected loss, per second
        return cost / t + (t / 2 + commit) / mtbf

    grid = [10.0 * k for k in range(1, 2000)]
    best = min(grid, key=lost)
    assert abs(best - chosen.save_interval_s) <= 10.0  # the grid's step
    assert chosen.expected_loss_per_hour_s == pytest.approx(3600 / mtbf * (best / 2 + commit), 0.01)


def test_the_interval_is_bounded_by_the_storage_and_the_mtbf() -> None:
    # Slow storage, frequent failures: Young-Daly says 60 s, the storage commits in 300 s.
    slow = choose(Costs(stall_s=1.0, commit_s=300.0, mtbf_s=1800.0))
    assert young_daly_s(1.0, 1800.0) == 60.0
    assert slow.save_interval_s == 300.0 and "durable commit" in slow.interval_reason
    # A save that costs more than half the MTBF: at most the MTBF (Daly's limit).
    dear = choose(Costs(stall_s=2000.0, mtbf_s=1800.0))
    assert dear.save_interval_s == 1800.0 and "the MTBF" in dear.interval_reason
    # A year between failures: capped at LONGEST_S.
    calm = choose(Costs(stall_s=60.0, mtbf_s=365 * _DAY_S))
    assert calm.save_interval_s == LONGEST_S


def test_the_job_pays_the_slowest_ranks_costs_and_the_coordinators_mtbf() -> None:
    ranks = [
        Costs(stall_s=1.0, commit_s=9.0, slowdown=0.1, mtbf_s=3600.0, mtbf_note="history"),
        Costs(stall_s=4.0, commit_s=2.0, slowdown=0.3),
        Costs(stall_s=2.0, commit_s=5.0, mtbf_s=1.0),  # a rank's MTBF other than 0's: never read
    ]
    job = agree(ranks)
    assert (job.stall_s, job.commit_s, job.slowdown) == (4.0, 9.0, 0.3)
    assert (job.mtbf_s, job.mtbf_note) == (3600.0, "history")


def _event(event: str, at: float, tier: str | None = "local") -> dict[str, Any]:
    line = {"event": event, "step": 1, "name": "step_1", "time": at}
    return line | ({} if tier is None else {"tier": tier})


def test_the_mtbf_is_the_prior_for_a_short_history_and_lengthens_while_nothing_fails() -> None:
    now = 1e9
    assert estimate_mtbf([], now)[0] == PRIOR_MTBF_S
    month = [_event("committed", now - 30 * _DAY_S), _event("committed", now - 1)]
    assert estimate_mtbf(month, now)[0] == PRIOR_MTBF_S + 30 * _DAY_S
    restarts = [month[0], *(_event("restored", now - d * _DAY_S) for d in (20, 10, 5))]
    mtbf, note = estimate_mtbf(restarts, now)
    assert mtbf == (PRIOR_MTBF_S + 30 * _DAY_S) / 4 and note.startswith("3 restarts")
    # Neither a planned stop's resume nor a warm start from another run is a failure.
    planned = [month[0], _event("preempted", now - 9, None), _event("restored", now - 8)]
    warm = [month[0], _event("restored", now - 8, "initial")]
    assert estimate_mtbf(planned, now)[0] == estimate_mtbf(warm, now)[0] == month_mtbf(now)


def month_mtbf(now: float) -> float:
    return estimate_mtbf([_event("committed", now - 30 * _DAY_S)], now)[0]


def test_auto_rejects_a_fixed_interval_and_a_bad_mtbf_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="interval_s"):
        SavePolicy(auto=True, interval_s=60)
    with pytest.raises(ConfigError, match="mtbf_s"):
        SavePolicy(auto=True, mtbf_s=0)
    with pytest.raises(ConfigError, match="auto"):
        SavePolicy(auto="yes")  # type: ignore[arg-type]


def test_auto_decides_on_the_agreed_costs_in_the_vote() -> None:
    policy = SavePolicy(auto=True)
    cheap, dear = Costs(stall_s=0.5, mtbf_s=3600.0), Costs(stall_s=8.0)  # sqrt(2*8*3600) = 240

    def votes(since: float) -> list[Vote]:
        return [Vote("maybe_save", 5, detail=Reading(since, None, c)) for c in (cheap, dear)]

    assert due(policy, 5, False, votes(239.0)) is None  # rank 1's cost sets the interval
    assert due(policy, 5, False, votes(240.0)) is not None


def test_the_slowdown_and_stall_are_measured_from_the_loops_votes() -> None:
    policy, clock = SavePolicy(auto=True), SkewedClock()
    meter = Goodput(policy, clock, (3600.0, "given"))
    t = 0.0
    for busy, gap in [(False, 1.0)] * 5 + [(False, 1.0)] + [(True, 4.0)] + [(True, 1.25)] * 6:
        t += gap
        costs = meter.vote(t, busy)
        meter.decided([costs], saving=(t == 6.0))  # the save starts at the sixth vote
    # Idle steps take 1 s, busy ones 1.25 s: a slowdown of 0.25; the save's step took 4 s: 3 s.
    assert costs.slowdown == pytest.approx(0.25) and costs.stall_s == pytest.approx(3.0)


def test_a_save_at_every_vote_still_counts_its_stall() -> None:
    # With no idle step timed yet, the whole gap counts: a stall of 0 would keep the interval
    # at 0, a save at every vote, and no idle step would ever be timed.
    meter = Goodput(SavePolicy(auto=True), SkewedClock(), (3600.0, "given"))
    for t in (10.0, 40.0, 70.0):
        costs = meter.vote(t, False)
        meter.decided([costs], saving=True)
    assert costs.stall_s == 30.0


def test_the_interval_follows_costs_that_change() -> None:
    meter, t = Goodput(SavePolicy(auto=True), SkewedClock(), (3600.0, "given")), 0.0

    def chosen_after_saves(stall_s: float, saves: int) -> float | None:
        nonlocal t
        for _ in range(saves):  # an idle step, a step that saves, a step it stalls
            for saving, gap in ((False, 1.0), (True, 1.0), (False, 1.0 + stall_s)):
                t += gap
                meter.decided([meter.vote(t, False)], saving=saving)
        return meter.choice().save_interval_s

    assert chosen_after_saves(2.0, 3) == pytest.approx(young_daly_s(2.0, 3600.0))
    slower = chosen_after_saves(11.0, 8)  # the moving average nears the new stall
    assert slower is not None and slower > 0.9 * young_daly_s(11.0, 3600.0)


# -- the expected work lost, against a simulated run ---------------------------------------------


@pytest.mark.parametrize(("cost_s", "commit_s"), [(30.0, 120.0), (5.0, 600.0), (300.0, 900.0)])
def test_the_expected_loss_per_hour_matches_a_simulated_run(cost_s: float, commit_s: float) -> None:
    """A training loop saving at the controller's interval, failures drawn from an exponential
    with the given MTBF; after each one the job restarts from the newest durable checkpoint (its
    schedule restarting with it), and the work since that checkpoint began is what was lost.

    Tolerance: the reported figure is first order in T/M (a failure restarts the schedule), a
    bias under T/(2M) (1.3 % at the largest T/M here); the simulated figure is a ratio of sums
    over n = 40,000 failures, whose standard error (delta method, from the sample) is about
    0.5 %; four of them plus the bias.
    """
    mtbf = _DAY_S
    chosen = choose(Costs(stall_s=cost_s, commit_s=commit_s, mtbf_s=mtbf))
    interval, reported = chosen.save_interval_s, chosen.expected_loss_per_hour_s
    assert interval is not None and reported is not None
    rng, lost, ran = random.Random(47), [], []
    for _ in range(40_000):
        up = rng.expovariate(1 / mtbf)  # seconds since the restart, until the next failure
        newest = max(0, math.floor((up - commit_s) / interval))  # durable: started >= L before
        lost.append(up - newest * interval)  # 0: the checkpoint restored at the restart
        ran.append(up)
    simulated = sum(lost) / sum(ran) * 3600
    ratio = statistics.fmean(lost) / statistics.fmean(ran)
    residuals = [(x - ratio * t) ** 2 for x, t in zip(lost, ran, strict=True)]
    stderr = math.sqrt(statistics.fmean(residuals) / len(ran)) / statistics.fmean(ran) * 3600
    assert abs(simulated - reported) <= 4 * stderr + reported * interval / (2 * mtbf)
    # Not vacuous: leaving the time to durable commit out, or counting a whole interval, fails.
    assert abs(simulated - loss_per_hour_s(interval, 0.0, mtbf)) > 4 * stderr
    assert abs(simulated - loss_per_hour_s(2 * interval, commit_s, mtbf)) > 4 * stderr


# -- the manager: real saves, a test clock -----------------------------------------------------


def _train(
    root: Path,
    policy: SavePolicy,
    *,
    in_flight_steps: int,
    steps: int = 400,
    telemetry: Telemetry | None = None,
) -> Any:
    """A loop of 1 s steps (1.5 s while a save is in flight: a slowdown of 0.5) whose saves
    block it 2 s more and stay in flight ``in_flight_steps`` steps (the storage's speed)."""
    clock, gate = SkewedClock(), threading.Event()
    writer = GatedWriter(root, gate)
    runtime = Runtime(executor="thread", writer=writer, clock=clock, telemetry=telemetry)
    with CheckpointManager(root, policy=policy, runtime=runtime) as manager:
        flying: tuple[Any, int] | None = None
        for step in range(1, steps + 1):
            clock.advance(1.0 if flying is None else 1.5)
            if flying is not None and step - flying[1] > in_flight_steps:
                gate.set()
                flying[0].replicated.result(timeout=_GATE_TIMEOUT_S)
                manager.wait(timeout_s=_GATE_TIMEOUT_S)  # its callbacks ran: the slot is free
                gate.clear()
                flying = None
            handle = manager.maybe_save(step, {"w": torch.full((4,), float(step))})
            if handle is not None:
                clock.advance(2.0)  # the save's step is 2 s longer (staging, the vote)
                flying = (handle, step)
        gate.set()
    return manager.stats()


def _expected_cost(in_flight_steps: int) -> tuple[float, float]:
    """(C, L) the schedule of :func:`_train` implies, by dcp_safe.manager.cadence's definitions:
    the save's step took 2 s + 1.5 s against 1 s idle (a stall of 2.5 s); durable after the
    2 s and the steps until its release at 1.5 s; the rest of that at a slowdown of 0.5."""
    stall, commit = 2.5, 2.0 + 1.5 * (in_flight_steps + 1)
    return stall + 0.5 * (commit - stall), commit


def test_auto_chooses_young_dalys_interval_from_the_costs_it_measured(tmp_path: Path) -> None:
    stats = _train(tmp_path, SavePolicy(auto=True, mtbf_s=3600.0), in_flight_steps=10)
    cost, commit = _expected_cost(10)  # 10.5 s, 18.5 s
    optimum = young_daly_s(cost, 3600.0)  # 275 s
    assert stats.save_cost_s == pytest.approx(cost, rel=0.05)
    assert stats.save_interval_s == pytest.approx(optimum, rel=0.10)
    assert stats.interval_reason.startswith("auto: sqrt(2 * cost")
    assert stats.expected_loss_per_hour_s == pytest.approx(
        3600 / 3600.0 * (stats.save_interval_s / 2 + commit), rel=0.05
    )
    assert stats.committed >= 2 and stats.skipped == 0


def test_slow_storage_and_a_small_mtbf_shorten_the_interval(tmp_path: Path) -> None:
    def interval(mtbf_s: float) -> Any:
        policy = SavePolicy(auto=True, mtbf_s=mtbf_s)
        return _train(tmp_path / str(mtbf_s), policy, in_flight_steps=30)

    steady, failing, dire = interval(_DAY_S), interval(600.0), interval(30.0)
    cost, commit = _expected_cost(30)  # 25.5 s, 48.5 s
    assert steady.save_interval_s == pytest.approx(young_daly_s(cost, _DAY_S), rel=0.10)
    assert failing.save_interval_s == pytest.approx(young_daly_s(cost, 600.0), rel=0.10)
    assert failing.save_interval_s < steady.save_interval_s / 4
    # Never shorter than the slow storage commits a save in: it would queue saves.
    assert dire.save_interval_s == pytest.approx(commit, rel=0.05)
    assert "durable commit" in dire.interval_reason


def _history(root: Path, events: list[dict[str, Any]]) -> None:
    root.mkdir(parents=True)
    lines = (json.dumps(e, sort_keys=True) + "\n" for e in events)
    (root / HISTORY_FILE).write_text("".join(lines), encoding="utf-8")


def test_a_failure_free_history_lengthens_the_interval(tmp_path: Path) -> None:
    now = time.time()
    _history(tmp_path / "calm", [_event("committed", now - 60 * _DAY_S)])
    twice_a_day = [_event("restored", now - (30 - d / 2) * _DAY_S) for d in range(60)]
    _history(tmp_path / "rough", twice_a_day)  # an MTBF of 31/61 days
    policy = SavePolicy(auto=True)
    fresh = _train(tmp_path / "fresh", policy, in_flight_steps=2)
    calm = _train(tmp_path / "calm", policy, in_flight_steps=2)
    rough = _train(tmp_path / "rough", policy, in_flight_steps=2)
    intervals = [s.save_interval_s for s in (rough, fresh, calm)]
    assert all(i is not None for i in intervals)
    assert intervals == sorted(intervals) and intervals[2] > 2 * intervals[1]  # sqrt(61) / 1
    assert calm.mtbf_s == pytest.approx(61 * _DAY_S, rel=0.01)
    assert "0 restarts in 1.44e+03 h" in calm.interval_reason


def test_every_cadence_reports_the_expected_loss(tmp_path: Path) -> None:
    stats = _train(tmp_path, SavePolicy(every=20, mtbf_s=7200.0), in_flight_steps=3, steps=110)
    # Saves every 20 steps: 16 of 1 s, 4 of 1.5 s in flight, 2 s more for the save's step;
    # each commits 2 s + 4 * 1.5 s after it starts.
    assert stats.interval_reason == "measured between commits (every=20)"
    assert stats.save_interval_s == pytest.approx(16 * 1.0 + 4 * 1.5 + 2.0)
    assert stats.expected_loss_per_hour_s == pytest.approx(3600 / 7200 * (24.0 / 2 + 8.0))
    assert stats.save_cost_s is None and stats.mtbf_s == 7200.0


def test_the_telemetry_and_prometheus_report_the_interval_and_the_loss(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    with Telemetry(sample_memory=False) as telemetry:
        prometheus = PrometheusSink(telemetry)
        policy = SavePolicy(auto=True, mtbf_s=3600.0)
        stats = _train(tmp_path, policy, in_flight_steps=10, telemetry=telemetry)
    marks = [e for e in telemetry.memory.events(EventKind.MARK) if e.name == "save_interval"]
    assert len(marks) == stats.committed  # one per commit
    last = marks[-1].attrs
    assert last["interval_reason"].startswith("auto: ") and last["mtbf_s"] == 3600.0
    samples = {
        s.name: s
        for family in text_string_to_metric_families(prometheus.exposition())
        for s in family.samples
    }
    assert samples["dcp_safe_save_interval_seconds"].value == last["save_interval_s"]
    assert samples["dcp_safe_expected_loss_per_hour_seconds"].value == pytest.approx(
        last["expected_loss_per_hour_s"]
    )
    sources = [
        s for s in prometheus.registry.collect() if s.name == "dcp_safe_save_interval_source"
    ]
    [active] = [x.labels for x in sources[0].samples if x.value == 1]
    assert active["dcp_safe_save_interval_source"] == "auto"
