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
* ``no_leftovers``: a sweep with grace 0 leaves nothing but committed checkpoints.

Default run: the seeds in :data:`CI_SEEDS` (each pinned to the scenario it draws, so a change
to the driver cannot silently change what CI covers), picked to reach the worst failure modes
known: a rank-0 follow-up slower than the deadline under ``wait`` and ``coalesce``, a crash on
an S3 root followed by a restart, a full disk on rank 0 (the history write fails), a replica
whose replications are superseded, a rank stopped past the deadline.

``DCP_SAFE_LONG=1`` runs ``DCP_SAFE_CHAOS_RUNS`` seeds (default 300) from
``DCP_SAFE_CHAOS_SEED0`` (default 0) across every variant, world size 4 included, and prints a
table of variants x faults with the number of runs and of runs with a violation;
``DCP_SAFE_CHAOS_REPORT=path`` also writes it as ``path.json`` and ``path.md`` (rewritten after
each run, so an interrupted campaign still leaves its table).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
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
from e2e._chaos_driver import run_chaos
from e2e._chaos_plan import (
    BUSY_POLICIES,
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


def _report(reports: list[RunReport]) -> str:
    if REPORT_PATH:
        return write_summary(reports, REPORT_PATH)
    return summarize(reports)[1]


def test_ci_seeds_draw_the_scenarios_they_were_picked_for() -> None:
    """A run is a pure function of its seed: the pinned seeds still draw what they cover."""
    for seed, label in CI_SEEDS.items():
        assert scenario_for(seed).label == label
        assert scenario_for(seed) == scenario_for(seed)


def test_the_long_mode_draws_every_variant_and_every_fault() -> None:
    """Over the long mode's default number of seeds, every root kind, policy, staging mode,
    world size and fault kind is drawn."""
    scenarios = [scenario_for(seed, long_mode=True) for seed in range(300)]
    assert {s.roots for s in scenarios} == set(ROOT_KINDS)
    assert {s.when_busy for s in scenarios} == set(BUSY_POLICIES)
    assert {s.staging for s in scenarios} == set(STAGING_MODES)
    assert {s.world_size for s in scenarios} == {2, 4}
    assert {s.restart_world_size for s in scenarios} == {1, 2, 4}
    assert {f.kind for s in scenarios for f in s.faults} == set(FAULT_KINDS)
    assert any(len(s.faults) == 2 for s in scenarios)


# -- the checks catch what they are named for (no processes: hand-made phases and roots) -----


def _scenario(*faults: Fault) -> Scenario:
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


@pytest.mark.multiproc
@pytest.mark.s3
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", sorted(CI_SEEDS))
def test_a_seeded_chaos_run_keeps_every_invariant(
    seed: int, tmp_path: Path, s3: LocalS3, caplog: pytest.LogCaptureFixture
) -> None:
    """One seeded run, faulty phase and restart: no invariant of the driver is broken."""
    caplog.set_level(logging.WARNING)  # not every S3 request and DCP step of the checks
    report = run_chaos(seed, tmp_path, s3)
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
