"""Chaos as a test suite: ``CheckpointManager`` on real gloo ranks under seeded faults.

Each run (``tests/e2e/_chaos_driver.py``) is drawn from its seed: a variant (world size 2 or 4,
a local root, a local root with an S3 replica, or node-local caches over an S3 root;
``when_busy`` skip/wait/coalesce; ``staging`` snapshot/overlap; small deadlines) and one or two
faults struck at a seeded point: SIGKILL of one rank or of all of them mid-save (from inside a
write, or from the parent after a delay), SIGSTOP of one rank past ``deadline_s``, slow storage
on one rank, injected storage errors (``faulty_fs``), retention on rank 0 slower than
``deadline_s``, a full disk on one rank (RLIMIT_FSIZE, EFBIG), S3 errors, delays, outages and a
refused history write (through the fault proxy in front of moto). Then the job restarts on the
same roots (a higher attempt, sometimes another world size), restores and saves again.

After each run the driver checks, by name, what a user must be able to rely on:

* ``bounded``: no rank hangs past its deadlines; every rank the faults spared reports;
* ``handles_resolve``: after ``close()`` every save handle's future is done;
* ``typed_errors``: every error the caller sees is a ``DcpSafeError`` (never a raw
  ``RuntimeError`` or ``OSError``);
* ``commit_errors_name_ranks``: a ``CommitError`` names ranks in ``failures``, and the
  survivors of a rank killed or stopped mid-save are told which;
* ``ranks_agree``: every rank recorded the same saves with the same outcomes;
* ``benign_faults_fail_nothing``: slowness that keeps within the deadlines fails no save;
* ``newest_kept``: retention never removes the newest committed checkpoint;
* ``restart_commits``: the restarted job starts, and its saves commit;
* ``restore_exact``: it restores the newest listed checkpoint, exactly, on every rank;
* ``listed_verify_and_load``: every listed checkpoint verifies deep and loads as its step;
* ``history_consistent``: every listed checkpoint has a ``committed`` event in the history;
* ``no_leftovers``: a sweep with grace 0 leaves nothing but committed checkpoints;
* ``default_path``: a manager built with no ``writer=`` saves in its checkpoint worker;
* ``no_process_outlives``: no worker outlives its rank, its closed manager or the job;
* ``no_startup_wait``: no save request waits on a worker's start-up (compared with the
  synchronous save of the same state, measured in the same run);
* ``worker_loss_recovers`` / ``full_disk_recovers``: after a worker's death or a lifted full
  disk, the job saves again.

About 60% of the seeds run the default path: managers built with no ``writer=``/``stager=``
(each rank's checkpoint worker process), the ranks launched as ``torchrun`` does, and faults
from outside the rank: SIGKILL/SIGSTOP of a rank or of its worker, a kill the moment the worker
process appears (of it, or of its rank), every rank killed, RLIMIT_FSIZE set on a rank and
lifted later, S3 faults (``e2e._chaos_plan``).

Default run: the seeds in :data:`CI_SEEDS` (each pinned to the scenario it draws, so a change
to the driver cannot silently change what CI covers), picked to reach the worst failure modes
known: a rank-0 follow-up slower than the deadline under ``wait`` and ``coalesce``, a crash on
an S3 root followed by a restart, a full disk on rank 0 (the history write fails), a replica
whose replications are superseded, a rank stopped past the deadline; and on the default path
(:data:`CI_DEFAULT_SEEDS`): a rank killed as its worker starts, a worker stopped under
``wait``.

``DCP_SAFE_LONG=1`` runs ``DCP_SAFE_CHAOS_RUNS`` seeds (default 300) from
``DCP_SAFE_CHAOS_SEED0`` (default 0) across every variant, world size 4 included, and prints a
table of variants x faults with the number of runs and of runs with a violation;
``DCP_SAFE_CHAOS_REPORT=path`` also writes it as ``path.json`` and ``path.md`` (rewritten after
each run, so an interrupted campaign still leaves its table).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from e2e import _chaos_driver
from e2e._chaos_checks import (
    Phase,
    Roots,
    RunReport,
    check_loss,
    check_phase,
    check_roots,
    fresh_dir,
    summarize,
    write_summary,
)
from e2e._chaos_driver import ProcessWatch, run_chaos
from e2e._chaos_plan import (
    BUSY_POLICIES,
    DEFAULT_FAULTS_BY_ROOTS,
    FAULT_KINDS,
    ROOT_KINDS,
    STAGING_MODES,
    Fault,
    Scenario,
    global_state,
    scenario_for,
)

from dcp_safe import CheckpointManager, layout
from dcp_safe.checkpoints.history import HISTORY_FILE
from dcp_safe.testing.s3 import LocalS3

pytestmark = pytest.mark.worker_process  # "auto" keeps choosing the worker here

LONG = os.environ.get("DCP_SAFE_LONG") == "1"
LONG_RUNS = int(os.environ.get("DCP_SAFE_CHAOS_RUNS", "300"))
LONG_SEED0 = int(os.environ.get("DCP_SAFE_CHAOS_SEED0", "0"))
REPORT_PATH = os.environ.get("DCP_SAFE_CHAOS_REPORT")

# seed -> the scenario it draws (checked by test_ci_seeds_draw_the_scenarios_they_were_picked_for)
CI_SEEDS = {
    # rank 0's retention outlasts deadline_s while the other rank waits for its slot (wait)
    240: "seed 240: local/wait/snapshot/ws2->1 slow_follow_up(r0@s1)",
    # the same under coalesce, with an S3 replica: every rank must start the same coalesced
    # saves, later saves must still work (or fail typed), superseded replications leave nothing
    459: "seed 459: replica/coalesce/snapshot/ws2->1 slow_follow_up(r0@s1)",
    # the coordinator dies mid-save on an S3 root; the restart saves the step it was writing
    359: "seed 359: node_local/wait/overlap/ws2->1 kill_rank(r0@s2)",
    # rank 0's disk fills up (EFBIG): its shard writes and its history appends fail
    185: "seed 185: local/skip/overlap/ws2->1 fsize(r0@s2)",
    # rank 0 hangs (SIGSTOP) inside a save: the survivor is told within the deadline
    2: "seed 2: local/skip/overlap/ws2->1 stop_rank(r0@s3)",
}
# The same on the default path (the managers' own writer, each rank's checkpoint worker).
CI_DEFAULT_SEEDS = {
    # rank 1 dies while its worker imports: the worker must not outlive it (nor commit for it)
    32: "seed 32: default:local/skip/overlap/ws2->1 kill_rank_startup(r1)",
    # rank 0's worker stopped under `wait`: detected, killed, the job saves again; close() ends
    240: "seed 240: default:local/wait/snapshot/ws2->1 stop_worker(r0@0.5s)",
}
# Pinned, run with DCP_SAFE_LONG=1 only (CI's time): a rank's disk full from step 1 to 3, so
# its worker starts under the limit and must write again once it is lifted (alone, and with
# the other rank's first worker killed as it starts).
LONG_PINNED = {
    203: "seed 203: default:local/wait/snapshot/ws2->1 fsize(r1@s1-s3)",
    35: "seed 35: default:local/coalesce/overlap/ws2->2 kill_worker_startup(r1) + fsize(r0@s1-s3)",
}


def _report(reports: list[RunReport]) -> str:
    if REPORT_PATH:
        return write_summary(reports, REPORT_PATH)
    return summarize(reports)[1]


def test_ci_seeds_draw_the_scenarios_they_were_picked_for() -> None:
    """A run is a pure function of its seed: the pinned seeds still draw what they cover."""
    for seeds, default_path in ((CI_SEEDS, False), (CI_DEFAULT_SEEDS, True), (LONG_PINNED, True)):
        for seed, label in seeds.items():
            assert scenario_for(seed, default_path=default_path).label == label
            assert scenario_for(seed) == scenario_for(seed)


def test_the_long_mode_draws_every_variant_and_every_fault() -> None:
    """Over the long mode's default number of seeds, every root kind, policy, staging mode,
    world size and fault kind is drawn, and at least half the runs take the default path,
    with every fault from outside the rank."""
    scenarios = [scenario_for(seed, long_mode=True) for seed in range(300)]
    assert {s.roots for s in scenarios} == set(ROOT_KINDS)
    assert {s.when_busy for s in scenarios} == set(BUSY_POLICIES)
    assert {s.staging for s in scenarios} == set(STAGING_MODES)
    assert {s.world_size for s in scenarios} == {2, 4}
    assert {s.restart_world_size for s in scenarios} == {1, 2, 4}
    assert {f.kind for s in scenarios for f in s.faults} == set(FAULT_KINDS)
    assert any(len(s.faults) == 2 for s in scenarios)
    default = [s for s in scenarios if s.default_path]
    assert len(default) >= len(scenarios) / 2
    outside = {kind for kinds in DEFAULT_FAULTS_BY_ROOTS.values() for kind in kinds}
    assert {f.kind for s in default for f in s.faults} == outside
    assert {s.roots for s in default} == set(ROOT_KINDS)


# -- the checks catch what they are named for (no processes: hand-made phases and roots) -----


def _scenario(*faults: Fault, default_path: bool = False) -> Scenario:
    return Scenario(
        seed=0,
        world_size=2,
        restart_world_size=2,
        roots="local",
        when_busy="wait",
        staging="snapshot",
        faults=faults or (Fault("fsize", rank=1, step=2),),
        deadline_s=4.0,
        wait_timeout_s=8.0,
        step_s=0.1,
        default_path=default_path,
    )


def _error(type_: str = "dcp_safe.errors.CommitError", **fields: Any) -> dict[str, Any]:
    error = {
        "where": "committed",
        "step": 2,
        "type": type_,
        "typed": type_.startswith("dcp_safe."),
        "commit_error": type_.endswith("CommitError"),
        "failures": {1: "did not finish its part of the save"},
        "message": "save was not published",
    }
    return error | fields


def _rank(rank: int, outcomes: dict[int, str], *errors: dict[str, Any]) -> dict[str, Any]:
    return {
        "rank": rank,
        "outcomes": outcomes,
        "replication_pending": [],
        "errors": list(errors),
        "decisions": [("requested", step, "local") for step in outcomes],
        "history": [],
    }


def _request(step: int, stall_s: float, ready: bool | None, at: float = 0.0) -> dict[str, Any]:
    return {"step": step, "stall_s": stall_s, "ready": ready, "at": at}


def _worker_rank(rank: int, outcomes: dict[int, str], *requests: dict[str, Any]) -> dict[str, Any]:
    """A rank of a default-path run: a synchronous save took 0.2 s."""
    extra = {"executor": "process", "sync_s": 0.2, "requests": list(requests)}
    return _rank(rank, outcomes) | extra


def _broken(phase: Phase, scenario: Scenario | None = None) -> list[str]:
    report = RunReport(seed=0, variant="", faults=(), label="hand-made")
    check_phase(scenario or _scenario(), phase, report, restart=False)
    return report.broken


def test_the_checks_pass_a_phase_where_nothing_is_wrong() -> None:
    """Two ranks, the same outcomes, a failure both were told of by a CommitError naming rank 1."""
    failed = _error()
    phase = Phase({r: _rank(r, {1: "committed", 2: "failed"}, failed) for r in (0, 1)})
    assert _broken(phase) == []


@pytest.mark.parametrize(
    ("check", "phase"),
    [
        # rank 1 never reported, and nothing killed or stopped it
        ("bounded", Phase({0: _rank(0, {1: "committed"})}, failures={1: "still running"})),
        ("bounded", Phase({0: _rank(0, {1: "committed"})}, timed_out=(1,))),
        (
            "handles_resolve",
            Phase({r: _rank(r, {1: "committed", 2: "pending"}) for r in (0, 1)}),
        ),
        # a replication still running while close() said nothing about work left in flight
        (
            "handles_resolve",
            Phase({r: _rank(r, {1: "committed"}) | {"replication_pending": [1]} for r in (0, 1)}),
        ),
        (
            "typed_errors",
            Phase(
                {
                    0: _rank(0, {2: "failed"}, _error("builtins.RuntimeError")),
                    1: _rank(1, {2: "failed"}, _error()),
                }
            ),
        ),
        (
            "commit_errors_name_ranks",
            Phase({r: _rank(r, {2: "failed"}, _error(failures={})) for r in (0, 1)}),
        ),
        (
            "ranks_agree",
            Phase({0: _rank(0, {2: "committed"}), 1: _rank(1, {2: "failed"}, _error())}),
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_check_catches_what_it_is_named_for(check: str, phase: Phase) -> None:
    assert _broken(phase) == [check]


_KILLED_WORKER = _scenario(Fault("kill_worker", rank=1, at_s=1.0), default_path=True)


@pytest.mark.parametrize(
    ("check", "scenario", "phase"),
    [
        (
            "default_path",
            _KILLED_WORKER,
            Phase({r: _worker_rank(r, {1: "committed"}) | {"executor": "thread"} for r in (0, 1)}),
        ),
        # the parent saw a worker outlive its rank, or the phase
        (
            "no_process_outlives",
            None,
            Phase({r: _rank(r, {1: "committed"}) for r in (0, 1)}, outlived=["a worker ran"]),
        ),
        # a rank's worker still ran after close()
        (
            "no_process_outlives",
            None,
            Phase(
                {r: _rank(r, {1: "committed"}) | {"workers_after_close": [r + 7]} for r in (0, 1)}
            ),
        ),
        # step 2 was requested while the worker started, and waited 3 s (a sync save: 0.2 s)
        (
            "no_startup_wait",
            _scenario(Fault("kill_timer", rank=1, at_s=9.0), default_path=True),
            Phase(
                {
                    r: _worker_rank(
                        r,
                        {1: "committed", 2: "committed"},
                        _request(1, 0.01, False),
                        _request(2, 3.0, False),
                    )
                    for r in (0, 1)
                }
            ),
        ),
        # the worker was killed at t=5: both later requests failed
        (
            "worker_loss_recovers",
            _KILLED_WORKER,
            Phase(
                {
                    r: _worker_rank(
                        r,
                        {1: "committed", 2: "failed", 3: "failed"},
                        _request(1, 0.01, True, at=1.0),
                        _request(2, 0.01, True, at=6.0),
                        _request(3, 0.01, False, at=7.0),
                    )
                    for r in (0, 1)
                },
                struck={"kill_worker": 5.0},
            ),
        ),
        # the limit was lifted before step 4: steps 4 to 6 still failed
        (
            "full_disk_recovers",
            _scenario(Fault("fsize", rank=0, step=2, count=4), default_path=True),
            Phase(
                {
                    r: _worker_rank(
                        r,
                        {s: "failed" for s in range(2, 7)} | {1: "committed"},
                        *(_request(s, 0.01, True, at=s) for s in range(1, 7)),
                    )
                    for r in (0, 1)
                }
            ),
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_check_of_the_default_path_catches_what_it_is_named_for(
    check: str, scenario: Scenario | None, phase: Phase
) -> None:
    # The failures here are the faults' (CommitErrors named): only the check itself may break.
    for result in phase.results.values():
        for step, outcome in result["outcomes"].items():
            if outcome == "failed":
                result["errors"].append(_error(step=step))
    assert _broken(phase, scenario) == [check]


def test_a_request_waiting_for_a_ready_worker_or_a_failing_save_is_no_startup_wait() -> None:
    """Only a request made while the worker was not ready, and not failed by a fault, is
    judged against the synchronous save."""
    requests = (_request(1, 0.01, False), _request(2, 3.0, True), _request(3, 3.0, False))
    outcomes = {1: "committed", 2: "committed", 3: "failed"}
    phase = Phase({r: _worker_rank(r, outcomes, *requests) for r in (0, 1)})
    for result in phase.results.values():
        result["errors"].append(_error(step=3))
    killed = _scenario(Fault("kill_timer", rank=1, at_s=9.0), default_path=True)
    assert _broken(phase, killed) == []


def test_requests_skipped_under_skip_are_no_failure_to_save_again() -> None:
    """Under ``when_busy="skip"`` the requests after a worker's death skipped while a save was
    in flight are the policy; the same skips under ``wait`` (waits that expired) are not."""
    requests = [_request(s, 0.01, False, at=s) for s in (1, 2, 3)]
    outcomes = {1: "committed", 2: "skipped", 3: "skipped"}
    phase = Phase(
        {r: _worker_rank(r, outcomes, *requests) for r in (0, 1)}, struck={"kill_worker": 1.5}
    )
    skip = dataclasses.replace(_KILLED_WORKER, when_busy="skip")
    assert _broken(phase, skip) == []
    assert _broken(phase, _KILLED_WORKER) == ["worker_loss_recovers"]


@pytest.mark.timeout(120)
def test_the_watch_sees_a_worker_outlive_its_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A "rank" whose "worker" (a child with the worker's command line) outlives it by more
    than the grace is reported; one that dies with its rank is not."""
    monkeypatch.setattr(_chaos_driver, "OUTLIVE_GRACE_S", 0.5)
    scenario = _scenario(default_path=True)
    job = _chaos_driver.Job(scenario, "faulty", 0, "", None, None, (), str(tmp_path))
    # The rank starts its worker (a sleeper named like one), writes its pid file, then waits.
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, pathlib, subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)',"
        " 'dcp_safe/worker/boot.py'])\n"
        f"pathlib.Path({str(tmp_path / 'faulty_rank0.pid')!r}).write_text(str(os.getpid()))\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    with rank.stdout:
        worker = int(rank.stdout.readline())
    watch = ProcessWatch(job, world_size=1)
    try:
        deadline = time.monotonic() + 30
        while worker not in watch.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker in watch.seen
        rank.kill()
        rank.wait()
        while not watch.outlived and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.finish()
    assert len(watch.outlived) == 1 and f"pid {worker}" in watch.outlived[0], watch.outlived
    while psutil.pid_exists(worker) and time.monotonic() < deadline + 30:
        if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)  # the watch killed it: the next run must not inherit it
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"


def test_a_failure_under_benign_faults_is_a_violation() -> None:
    """Retention slower than the deadline kills nobody: a failed save is not excused by it."""
    slow = _scenario(Fault("slow_follow_up", rank=0, step=1, seconds=5.0))
    phase = Phase({r: _rank(r, {1: "committed", 2: "failed"}, _error()) for r in (0, 1)})
    assert _broken(phase, slow) == ["benign_faults_fail_nothing"]


def test_a_survivor_must_be_told_which_rank_died() -> None:
    """Rank 1 was SIGKILLed mid-save; rank 0 saw its save fail, but not by a CommitError."""
    killed = _scenario(Fault("kill_rank", rank=1, step=2))
    error = _error("dcp_safe.errors.StorageError")
    phase = Phase({0: _rank(0, {2: "failed"}, error)}, failures={1: "process died"})
    report = RunReport(seed=0, variant="", faults=(), label="hand-made")
    check_loss(killed, phase, report)
    assert report.broken == ["commit_errors_name_ranks"]


def test_the_root_checks_catch_corruption_leftovers_and_a_lost_history(tmp_path: Path) -> None:
    """A flipped byte, a stray object in a committed checkpoint and a lost history file are
    each caught, by name, on a root one process saved to."""
    root = tmp_path / "root"
    with CheckpointManager(root, keep_last=5) as manager:
        for step in (1, 2):
            handle = manager.save(step, global_state(step))
            assert handle is not None
            handle.committed.result(timeout=60)
    shard = next((root / "step_000000002").glob(f"*{layout.SHARD_SUFFIX}"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (root / "step_000000001" / layout.RANKS_DIR / "rank_00001.skipped-0123").write_bytes(b"")
    (root / HISTORY_FILE).unlink()
    report = RunReport(seed=0, variant="", faults=(), label="hand-made")
    roots = Roots(str(root), None, (), None, None)
    check_roots(roots, [Phase({}), Phase({})], report)
    assert report.broken == ["history_consistent", "listed_verify_and_load", "no_leftovers"]


# -- seeded runs ------------------------------------------------------------------------------


_LONG_ONLY = [pytest.mark.slow, pytest.mark.skipif(not LONG, reason="set DCP_SAFE_LONG=1")]
_CI_RUNS = [pytest.param(seed, False, id=f"writer-{seed}") for seed in sorted(CI_SEEDS)]
_CI_RUNS += [pytest.param(seed, True, id=f"default-{seed}") for seed in sorted(CI_DEFAULT_SEEDS)]
_CI_RUNS += [
    pytest.param(seed, True, id=f"default-{seed}", marks=_LONG_ONLY) for seed in LONG_PINNED
]


@pytest.mark.multiproc
@pytest.mark.s3
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("seed", "default_path"), _CI_RUNS)
def test_a_seeded_chaos_run_keeps_every_invariant(
    seed: int,
    default_path: bool,
    tmp_path: Path,
    s3: LocalS3,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One seeded run, faulty phase and restart: no invariant of the driver is broken."""
    caplog.set_level(logging.WARNING)  # not every S3 request and DCP step of the checks
    report = run_chaos(seed, tmp_path, s3, default_path=default_path)
    assert not report.violations, report.text()


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.s3
@pytest.mark.timeout(max(LONG_RUNS, 1) * 600)
@pytest.mark.skipif(not LONG, reason="set DCP_SAFE_LONG=1")
def test_a_long_chaos_campaign_keeps_every_invariant(
    tmp_path: Path,
    s3: LocalS3,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``DCP_SAFE_CHAOS_RUNS`` seeded runs across every variant; the table of variants x faults
    is printed (and written to ``DCP_SAFE_CHAOS_REPORT``); no run may break an invariant."""
    caplog.set_level(logging.WARNING)
    reports: list[RunReport] = []
    for seed in range(LONG_SEED0, LONG_SEED0 + LONG_RUNS):
        run_dir = fresh_dir(tmp_path, seed)
        report = run_chaos(seed, run_dir, s3, long_mode=True)
        reports.append(report)
        if not report.violations:
            shutil.rmtree(run_dir, ignore_errors=True)  # keep the failed runs' roots only
        table = _report(reports)
        with capsys.disabled():
            status = ", ".join(report.broken) or "ok"
            print(f"[chaos {len(reports)}/{LONG_RUNS}] {report.label}: {status}", flush=True)
    with capsys.disabled():
        print(table, flush=True)
    assert not any(r.violations for r in reports), table


def test_a_sub_second_wait_behind_the_first_save_is_no_startup_wait() -> None:
    """Behind the first save on a thread a request pays that save's one-time costs and its
    follow-up's storage calls (0.3 to 0.7 s seen): judged against a start-up's seconds, not
    only against the synchronous save's 0.05 s."""
    requests = (_request(1, 0.03, False), _request(2, 0.7, False))
    outcomes = {1: "committed", 2: "committed"}
    phase = Phase({r: _worker_rank(r, outcomes, *requests) for r in (0, 1)})
    for result in phase.results.values():
        result["sync_s"] = 0.05
    killed = _scenario(Fault("kill_timer", rank=1, at_s=9.0), default_path=True)
    assert _broken(phase, killed) == []
