"""The invariants a chaos run is checked against, each by name; and the table of many runs.

A check reads what the ranks returned (:class:`Phase`) and what the roots hold afterwards
(:class:`Roots`), and adds a :class:`Violation` naming itself to the run's :class:`RunReport`;
it never raises for a broken invariant, so one run reports everything it broke.

The checks (:data:`CHECKS`):

* ``bounded``: each phase ends within its bound (no rank hangs past its deadlines), and every
  rank the faults did not kill or stop reports a result;
* ``handles_resolve``: after ``close()`` every save handle's ``committed`` future is done (and
  its ``replicated`` one too, unless ``close()`` said it gave up on work in flight);
* ``typed_errors``: every error that reaches the caller (raised by a manager call, or carried by
  a handle's future) is a :class:`~dcp_safe.errors.DcpSafeError`;
* ``commit_errors_name_ranks``: every ``CommitError`` names ranks of the job in ``failures``; a
  survivor of a rank killed or stopped during a save is told by a ``CommitError`` naming it;
* ``ranks_agree``: over the steps every reporting rank requested, the ranks recorded the same
  events (``manager.decisions()``) and the same outcome for each request;
* ``benign_faults_fail_nothing``: under benign faults only, nothing failed or raised;
* ``newest_kept``: the newest checkpoint a handle reported committed is still listed, after the
  faulty phase and after the restart (retention never removes it);
* ``restart_commits``: the restarted job starts, and its saves commit on every rank;
* ``restore_exact``: the restart restores the newest listed checkpoint, exactly, on every rank;
* ``listed_verify_and_load``: every listed checkpoint on every root verifies deep and loads, in
  one process, as exactly the state of its step;
* ``history_consistent``: every checkpoint listed on a root has a ``committed`` event for that
  tier in the history;
* ``no_leftovers``: after a sweep with grace 0, a root holds committed checkpoints (their own
  files only), the history and the attempt records, and no open multipart upload;
* ``default_path``: a manager built with no ``writer=`` (a default-path run) saves in its
  checkpoint worker process (``manager.executor == "process"``);
* ``no_process_outlives``: no checkpoint worker runs on a few seconds after its rank died, none
  after ``close()`` returned or raised (a stopped one included), and no rank or worker process
  of a phase after it ended;
* ``no_startup_wait``: a save requested while its worker was not ready (not started, starting,
  or a replacement starting) returned within :data:`STARTUP_FACTOR` times the synchronous save
  of the same state measured in the same phase, unless a fault held a save in flight; and in a
  phase with no fault holding or failing saves, the synchronous fallback did not engage;
* ``worker_loss_recovers``: after a checkpoint worker was killed (mid-job or at its start-up)
  with every rank alive, the job saves again: of two or more requests after the kill (not
  counting those ``when_busy="skip"`` skipped), one commits on every rank (after a SIGSTOP:
  of those requested twice the longer of ``deadline_s`` and ``wait_timeout_s`` after it, the
  bound to find a stopped worker out);
* ``full_disk_recovers``: once a rank lifts the RLIMIT_FSIZE it set (the disk has room
  again), a save requested from then on commits on every rank (its worker too must write
  under the rank's current limit).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from e2e._chaos_plan import (
    BENIGN,
    RANK_LOSS,
    RESTART_SAVES,
    Scenario,
    blank_full,
    global_state,
    name_of,
    step_of,
)

import dcp_safe
from dcp_safe import SafeStorageReader, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.history import HISTORY_FILE, History
from dcp_safe.retention.sweeper import sweep_partials
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
from dcp_safe.testing.s3 import LocalS3

__all__ = [
    "CHECKS",
    "STARTUP_FACTOR",
    "Phase",
    "Roots",
    "RunReport",
    "Violation",
    "belongs_to_checkpoint",
    "check_after_faults",
    "check_loss",
    "check_phase",
    "check_restart",
    "check_roots",
    "fresh_dir",
    "report_as_json",
    "summarize",
    "write_summary",
]

CHECKS = (
    "bounded",
    "handles_resolve",
    "typed_errors",
    "commit_errors_name_ranks",
    "ranks_agree",
    "benign_faults_fail_nothing",
    "newest_kept",
    "restart_commits",
    "restore_exact",
    "listed_verify_and_load",
    "history_consistent",
    "no_leftovers",
    "default_path",
    "no_process_outlives",
    "no_startup_wait",
    "worker_loss_recovers",
    "full_disk_recovers",
)

# A request waiting for one save in flight on a thread waits about one synchronous save (and
# a vote's jitter on a loaded host: 2.6 times it was seen at a load of 11 on 2 cores); a
# worker's start-up is an interpreter importing torch, 30 to 50 times it where one was waited on.
STARTUP_FACTOR = 4.0
# ... and never under a second: a start-up waited on is seconds (1 to 4 s quiet, 8 to 15 s
# loaded), while a request behind the first save on a thread pays that save's one-time costs
# (its plan, its slabs) and a follow-up's storage calls (retention on an S3 replica), as the
# thread executor does (0.3 to 0.7 s against a 0.05 s synchronous save: chaos seeds 16, 164).
STARTUP_FLOOR_S = 1.0
# Faults that hold a save in flight (a request behind it waits, for reasons of its own).
_HOLDING = frozenset(
    {"s3_outage", "s3_delay", "stop_worker", "stop_timer", "stop_rank", "slow_rank"}
) | {"slow_follow_up"}

# -- the parent: one run ------------------------------------------------------------------------


@dataclass
class Violation:
    check: str
    detail: str


@dataclass
class RunReport:
    """What one seeded run found."""

    seed: int
    variant: str
    faults: tuple[str, ...]
    label: str
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, check: str, detail: str) -> None:
        assert check in CHECKS, check
        self.violations.append(Violation(check, detail[:600]))

    @property
    def broken(self) -> list[str]:
        return sorted({v.check for v in self.violations})

    def text(self) -> str:
        lines = [f"{self.label} ({self.seconds:.0f} s)"]
        lines += [f"  [{v.check}] {v.detail}" for v in self.violations]
        return "\n".join(lines)


@dataclass
class Phase:
    """A phase's outcome as the parent saw it.

    Attributes:
        results: what each rank that finished returned, by rank.
        failures: the ranks that failed or died, each with run_ranks' description.
        timed_out: the ranks still running at the phase's bound (then killed).
        seconds: how long the phase took, spawning included.
        outlived: the processes of the phase that outlived their rank or the phase, described
            (the driver's ``ProcessWatch``).
        struck: when (``time.monotonic()``, the same clock in every process of the host) the
            parent struck each fault kind it strikes.
    """

    results: dict[int, dict[str, Any]]
    failures: dict[int, str] = field(default_factory=dict)
    timed_out: tuple[int, ...] = ()
    seconds: float = 0.0
    outlived: list[str] = field(default_factory=list)
    struck: dict[str, float] = field(default_factory=dict)


@dataclass
class Roots:
    """The run's storage: what the ranks are given, and how the parent opens each root."""

    root: str
    replica: str | None
    node_dirs: tuple[str, ...]
    bucket: str | None
    s3: LocalS3 | None

    def options(self, url: str) -> dict[str, Any] | None:
        if url.startswith("s3://"):
            assert self.s3 is not None
            return self.s3.storage_options()
        if url.startswith("faulty://"):
            return {"target_protocol": "file", "faults": FaultInjector(FaultPlan())}
        return None

    def primary(self) -> str:
        """Where checkpoints commit (and the history lives)."""
        return self.root

    def all(self) -> list[tuple[str, str]]:
        """Every root with its history tier."""
        roots = [(self.root, "local")]
        if self.replica is not None:
            roots.append((self.replica, "remote"))
        return roots


# -- the checks ---------------------------------------------------------------------------------


def _lost_ranks(scenario: Scenario, phase: Phase) -> set[int]:
    """The ranks this phase's faults killed or stopped (they owe no result)."""
    lost: set[int] = set()
    for fault in scenario.faults:
        if fault.kind in RANK_LOSS:
            lost |= set(range(scenario.world_size)) if fault.rank < 0 else {fault.rank}
    died = {r for r, why in phase.failures.items() if "died" in why or "stopped" in why}
    return lost & died


def check_phase(scenario: Scenario, phase: Phase, report: RunReport, *, restart: bool) -> None:
    """What every phase must show: bounded, resolved, typed, named, agreed; and, in the faulty
    phase of a scenario with benign faults only, no failure at all."""
    where = "restart" if restart else "faulty phase"
    world_size = scenario.restart_world_size if restart else scenario.world_size
    if phase.timed_out:
        report.add("bounded", f"{where}: ranks {list(phase.timed_out)} still ran at the bound")
    lost = set() if restart else _lost_ranks(scenario, phase)
    for rank in range(world_size):
        if rank not in phase.results and rank not in lost and not phase.timed_out:
            why = phase.failures.get(rank, "no result")
            report.add("bounded", f"{where}: rank {rank} gave no result: {why}")
    for rank, result in sorted(phase.results.items()):
        _check_rank(world_size, rank, result, report, where)
    _check_agreement(phase, report, where)
    _check_processes(phase, report, where)
    faults = () if restart else scenario.faults
    if scenario.default_path:
        for rank, result in sorted(phase.results.items()):
            if result.get("executor") not in (None, "process"):
                report.add(
                    "default_path",
                    f"{where}: rank {rank}'s manager, built with no writer=, chose executor "
                    f"{result['executor']!r}",
                )
        _check_startup_waits(faults, phase, report, where)
    if not restart:
        check_recovery(scenario, phase, report)
    if not restart and scenario.benign:
        for rank, result in sorted(phase.results.items()):
            for error in result["errors"]:
                report.add(
                    "benign_faults_fail_nothing",
                    f"rank {rank}: {error['where']} of step {error['step']}: "
                    f"{error['type']}: {error['message']}",
                )


def _check_rank(
    world_size: int, rank: int, result: dict[str, Any], report: RunReport, where: str
) -> None:
    for step, outcome in sorted(result["outcomes"].items()):
        if outcome == "pending":
            report.add("handles_resolve", f"{where}: rank {rank} step {step} pending after close")
    closed = [e["type"].rsplit(".", 1)[-1] for e in result["errors"] if e["where"] == "close"]
    if result["replication_pending"] and "DrainTimeoutError" not in closed:
        said = f"close() raised {closed[0]}" if closed else "close() returned"
        report.add(
            "handles_resolve",
            f"{where}: rank {rank}: replication of steps {result['replication_pending']} "
            f"still pending, yet {said} (no DrainTimeoutError)",
        )
    for error in result["errors"]:
        said = f"{where}: rank {rank}, {error['where']} (step {error['step']}): {error['type']}"
        if not error["typed"]:
            report.add("typed_errors", f"{said}: {error['message']}")
        if error["commit_error"]:
            named = set(error["failures"])
            if not named or not named <= set(range(world_size)):
                report.add("commit_errors_name_ranks", f"{said} names {sorted(named)}")


def _check_processes(phase: Phase, report: RunReport, where: str) -> None:
    """No process of the job outlives it: what the parent's watch saw, and each rank's own
    look at its children after ``close()``."""
    for line in phase.outlived:
        report.add("no_process_outlives", f"{where}: {line}")
    for rank, result in sorted(phase.results.items()):
        if result.get("workers_after_close"):
            report.add(
                "no_process_outlives",
                f"{where}: rank {rank}: checkpoint worker(s) {result['workers_after_close']} "
                "still ran after close() (and a grace of seconds)",
            )


def _check_startup_waits(
    faults: tuple[Any, ...], phase: Phase, report: RunReport, where: str
) -> None:
    """No request waits on a worker's start-up: a save requested while the worker was not
    ready returns within :data:`STARTUP_FACTOR` synchronous saves of the same state, or
    :data:`STARTUP_FLOOR_S` (saves that failed are not judged: a dead or stopped peer holds
    them, not a start-up)."""
    if any(f.kind in _HOLDING for f in faults):
        return
    if all(f.kind in BENIGN for f in faults):
        for rank, result in sorted(phase.results.items()):
            if result.get("fallback"):
                report.add(
                    "no_startup_wait",
                    f"{where}: rank {rank} fell back to synchronous saves with nothing failing "
                    f"or held: {result['fallback']}",
                )
    references = [r["sync_s"] for r in phase.results.values() if r.get("sync_s")]
    if not references:
        return
    bound = max(STARTUP_FACTOR * max(references), STARTUP_FLOOR_S)
    for rank, result in sorted(phase.results.items()):
        if result.get("executor") != "process":
            continue
        for request in result.get("requests", []):
            outcome = result["outcomes"].get(request["step"])
            if request["ready"] or outcome not in ("committed", "skipped"):
                continue
            if request["stall_s"] > bound:
                report.add(
                    "no_startup_wait",
                    f"{where}: rank {rank}: the request of step {request['step']} ({outcome}) "
                    f"took {request['stall_s']:.2f} s while its worker was not ready; the "
                    f"synchronous save of the same state took {max(references):.2f} s",
                )


def check_recovery(scenario: Scenario, phase: Phase, report: RunReport) -> None:
    """After a worker's death (every rank alive) or a lifted full disk, the job saves again."""
    if scenario.loses_a_rank:
        return
    for fault in scenario.faults:
        if any(f.kind not in BENIGN for f in scenario.faults if f is not fault):
            return  # another fault may fail the saves after it, for reasons of its own
        if fault.kind in ("kill_worker", "kill_worker_startup") and fault.kind in phase.struck:
            check, since, lift = "worker_loss_recovers", phase.struck[fault.kind], 0
        elif fault.kind == "stop_worker" and fault.kind in phase.struck:
            # A stopped worker is found out within a bound of the manager's deadlines.
            bound = 2 * max(scenario.deadline_s, scenario.wait_timeout_s)
            check, since, lift = "worker_loss_recovers", phase.struck[fault.kind] + bound, 0
        elif fault.kind == "fsize" and fault.count:
            check, since, lift = "full_disk_recovers", 0.0, fault.count
        else:
            continue
        # Under "skip" a request skipped while a save is in flight is the policy, not a failure
        # to save again (under "wait" and "coalesce" a skip is a wait that expired).
        ignored = ("skipped",) if scenario.when_busy == "skip" else ()
        for rank, result in sorted(phase.results.items()):
            requests = result.get("requests", [])
            steps = [r["step"] for r in requests if r["at"] > since and r["step"] >= lift]
            outcomes = {step: result["outcomes"].get(step) for step in steps}
            outcomes = {step: o for step, o in outcomes.items() if o not in ignored}
            steps = list(outcomes)
            if len(steps) >= 2 and "committed" not in outcomes.values():
                errors = sorted({f"{e['type']}: {e['message'][:120]}" for e in result["errors"]})
                report.add(
                    check,
                    f"rank {rank}: after {fault.label} no save committed: {outcomes}; {errors}",
                )


def _per_step(result: dict[str, Any]) -> dict[int, list[tuple[str, str | None]]]:
    steps: dict[int, list[tuple[str, str | None]]] = defaultdict(list)
    for event, step, tier in result["decisions"]:
        if step is not None:
            # On the replica, "failed" and "skipped" are one outcome (not replicated) whose
            # cause each rank sees from its own side: rank 0's commit of a save its peers had
            # already dropped for a newer one fails in an outage instead of reading their skip.
            if tier == "remote" and event in ("failed", "skipped"):
                event = "not replicated"
            steps[step].append((event, tier))
    return {step: sorted(events, key=str) for step, events in steps.items()}


def _check_agreement(phase: Phase, report: RunReport, where: str) -> None:
    """Over the steps every reporting rank requested: the same events and the same outcome."""
    if len(phase.results) < 2:
        return
    records = {rank: _per_step(result) for rank, result in phase.results.items()}
    common = set.intersection(*(set(r) for r in records.values()))
    # A replication still in flight on some rank when close() gave up (DrainTimeoutError) has
    # no outcome there yet: its remote events are compared only where every rank has one.
    unsettled = {s for result in phase.results.values() for s in result["replication_pending"]}
    for step in sorted(common):
        seen = {rank: records[rank][step] for rank in records}
        if step in unsettled:
            seen = {rank: [e for e in events if e[1] != "remote"] for rank, events in seen.items()}
        outcomes = {rank: phase.results[rank]["outcomes"].get(step) for rank in records}
        if len({str(v) for v in seen.values()}) > 1 or len(set(outcomes.values())) > 1:
            report.add(
                "ranks_agree",
                f"{where}: step {step}: outcomes {outcomes}, events "
                + "; ".join(f"rank {r}: {v}" for r, v in sorted(seen.items())),
            )


def check_loss(scenario: Scenario, phase: Phase, report: RunReport) -> None:
    """Survivors of a rank killed or stopped inside a save are told, by a CommitError naming it."""
    for fault in scenario.faults:
        if fault.kind not in ("kill_rank", "stop_rank"):
            continue
        if fault.rank not in _lost_ranks(scenario, phase):
            continue  # the save it waited for never came (skipped, or the loop stopped first)
        for rank, result in sorted(phase.results.items()):
            errors = [e for e in result["errors"] if e["commit_error"]]
            if not any(fault.rank in e["failures"] for e in errors):
                seen = [(e["where"], e["type"], sorted(e["failures"])) for e in result["errors"]]
                report.add(
                    "commit_errors_name_ranks",
                    f"rank {rank} was never told rank {fault.rank} failed ({fault.kind}): {seen}",
                )


def _committed_steps(phase: Phase) -> set[int]:
    return {
        step
        for result in phase.results.values()
        for step, outcome in result["outcomes"].items()
        if outcome == "committed"
    }


def _listed(roots: Roots, url: str) -> list[Any]:
    return dcp_safe.list_checkpoints(url, storage_options=roots.options(url))


def check_after_faults(roots: Roots, phase: Phase, report: RunReport) -> str | None:
    """After the faulty phase: retention kept the newest checkpoint a handle reported
    committed. Returns the newest listed name (what the restart must restore)."""
    try:
        listed = _listed(roots, roots.primary())
    except Exception as exc:
        report.add("listed_verify_and_load", f"listing after the faults failed: {exc!r}")
        return None
    names = [info.name for info in listed]
    committed = _committed_steps(phase)
    if committed and name_of(max(committed)) not in names:
        report.add(
            "newest_kept",
            f"after the faults: {name_of(max(committed))} committed but not listed ({names})",
        )
    return names[-1] if names else None


def check_restart(scenario: Scenario, phase: Phase, newest: str | None, report: RunReport) -> None:
    """The restarted job started, restored ``newest`` exactly on every rank, and committed
    every save it made, without an error."""
    for rank in range(scenario.restart_world_size):
        result = phase.results.get(rank)
        if result is None:
            why = phase.failures.get(rank, "timed out" if phase.timed_out else "no result")
            report.add("restart_commits", f"restart rank {rank} did not finish: {why}")
            continue
        for error in result["errors"]:
            report.add(
                "restart_commits",
                f"restart rank {rank}: {error['where']} (step {error['step']}): "
                f"{error['type']}: {error['message']}",
            )
        if len(result["committed"]) < RESTART_SAVES:
            report.add("restart_commits", f"restart rank {rank} committed {result['committed']}")
        if newest is not None and result["restored"] != newest:
            report.add("restore_exact", f"rank {rank} restored {result['restored']}, not {newest}")
        if result["wrong"]:
            report.add(
                "restore_exact", f"rank {rank} restored {result['restored']}: {result['wrong']}"
            )


def check_roots(roots: Roots, phases: list[Phase], report: RunReport) -> None:
    """Every root after both phases: the restart's newest checkpoint listed, every listed one
    verified, loaded and in the history, and nothing else left after a sweep."""
    history = _history(roots)
    restart_committed = _committed_steps(phases[1])
    for url, tier in roots.all():
        try:
            listed = _listed(roots, url)
        except Exception as exc:
            report.add("listed_verify_and_load", f"{tier}: listing failed: {exc!r}")
            continue
        names = [info.name for info in listed]
        if tier == "local" and restart_committed:
            newest = name_of(max(restart_committed))
            if newest not in names:
                report.add("newest_kept", f"{newest} committed by the restart, not listed: {names}")
        for info in listed:
            _check_checkpoint(roots, url, tier, info, report)
            if (info.name, tier) not in history:
                report.add("history_consistent", f"{tier}: {info.name} listed, no committed event")
        _check_leftovers(roots, url, tier, names, report)


def _history(roots: Roots) -> set[tuple[str, str]]:
    """(name, tier) of every committed event in the primary root's history file."""
    url = roots.primary()
    events = History(open_backend(url, roots.options(url))).read()
    return {
        (str(e.get("name")), str(e.get("tier") or "local"))
        for e in events
        if e.get("event") == "committed"
    }


def _check_checkpoint(roots: Roots, url: str, tier: str, info: Any, report: RunReport) -> None:
    """Deep verification, then a load in this process (no group) compared with its step."""
    options = roots.options(url)
    try:
        dcp_safe.verify_checkpoint(url, info.name, storage_options=options)
        state = blank_full()
        reader = SafeStorageReader(url, storage_options=options)
        dcp_safe.load(state, checkpoint_id=info.name, storage_reader=reader, no_dist=True)
    except Exception as exc:
        report.add("listed_verify_and_load", f"{tier}: {info.name}: {type(exc).__name__}: {exc}")
        return
    expected = global_state(step_of(info.name))
    wrong = [k for k, v in expected.items() if k != "meta" and not torch.equal(state[k], v)]
    if state["meta"] != expected["meta"] or info.step != step_of(info.name):
        wrong.append("meta")
    if wrong:
        report.add("listed_verify_and_load", f"{tier}: {info.name} loads wrong values: {wrong}")


_CONTROL = {
    layout.COMMITTED_MARKER,
    layout.MANIFEST,
    layout.DCP_METADATA,
    layout.SIGNATURE,
}
_RANK_MANIFEST = re.compile(rf"^{layout.RANKS_DIR}/rank_\d+\.json$")


def _check_leftovers(
    roots: Roots, url: str, tier: str, names: list[str], report: RunReport
) -> None:
    """Sweep with grace 0; then every object under the root must belong to a listed
    checkpoint (its manifest's files, its control files), the history or the attempts."""
    options = roots.options(url)
    try:
        sweep_partials(url, grace_s=0, storage_options=options)
    except Exception as exc:
        report.add("no_leftovers", f"{tier}: sweep failed: {type(exc).__name__}: {exc}")
        return
    own: dict[str, set[str]] = {}
    for name in names:
        own[name] = _files_of(roots, url, name)
    extra = [rel for rel in _walk(roots, url) if not belongs_to_checkpoint(rel, own)]
    if roots.s3 is not None and url.startswith("s3://") and roots.bucket is not None:
        uploads = roots.s3.open_uploads(roots.bucket)
        extra += [f"(open upload) {u.get('Key')}" for u in uploads]
    if extra:
        report.add("no_leftovers", f"{tier}: {sorted(extra)[:8]} ({len(extra)} in all)")


def _files_of(roots: Roots, url: str, name: str) -> set[str]:
    manifest = open_committed(open_backend(url, roots.options(url)), name).manifest
    return {record.path for record in manifest.files}


def belongs_to_checkpoint(rel: str, own: dict[str, set[str]]) -> bool:
    top, _, rest = rel.partition("/")
    if top == HISTORY_FILE and not rest:
        return True
    if top == layout.ATTEMPTS_DIR:
        return True
    if top not in own or not rest:
        return False
    return rest in own[top] or rest in _CONTROL or bool(_RANK_MANIFEST.match(rest))


def _walk(roots: Roots, url: str) -> Iterator[str]:
    """Every file under the root, relative to it."""
    if url.startswith("s3://"):
        assert roots.s3 is not None and roots.bucket is not None
        prefix = url.removeprefix(f"s3://{roots.bucket}/").rstrip("/") + "/"
        for key in roots.s3.keys(roots.bucket, prefix):
            yield key.removeprefix(prefix)
        return
    base = Path(url.removeprefix("faulty://"))
    # A faulty:// root publishes in place, as an object store does: there a folder is no
    # object, an empty one blocks no save (the lease is written into it), and a failed
    # removal can leave one behind. On a plain local root (publish by rename) an empty folder
    # under a checkpoint's name would refuse saves of that name, so it counts there.
    folders_count = not url.startswith("faulty://")
    if base.exists():
        for path in sorted(base.rglob("*")):
            if path.is_file() or path.is_symlink():
                yield path.relative_to(base).as_posix()
            elif folders_count and path.is_dir() and not any(path.iterdir()):
                yield path.relative_to(base).as_posix() + "/"


# -- the table ----------------------------------------------------------------------------------


def summarize(reports: list[RunReport]) -> tuple[dict[str, Any], str]:
    """The runs as a JSON-able summary and a markdown table of variants x faults.

    Each cell is ``runs / runs with a violation``; a second table counts the violated checks
    per fault kind, and every violating run is listed with its seed.
    """
    kinds = sorted({kind for r in reports for kind in r.faults})
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    by_check: dict[tuple[str, str], int] = Counter()
    for r in reports:
        row = "/".join(r.variant.split("/")[:3])
        for kind in set(r.faults):
            cells[(row, kind)][0] += 1
            cells[(row, kind)][1] += bool(r.violations)
            for check in r.broken:
                by_check[(check, kind)] += 1
    for kind in kinds:
        runs = [r for r in reports if kind in r.faults]
        cells[("all variants", kind)] = [len(runs), sum(bool(r.violations) for r in runs)]
    rows = [*sorted({row for row, _ in cells} - {"all variants"}), "all variants"]
    minutes = sum(r.seconds for r in reports) / 60
    default = sum(r.variant.startswith("default:") for r in reports)
    lines = [
        f"{len(reports)} runs ({minutes:.0f} min; {default} on the default path, rows"
        " `default:`), "
        f"{sum(bool(r.violations) for r in reports)} with a violation. "
        "Each cell: runs / runs with a violation (a run with two faults counts under both).",
        "",
        "| variant | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for row in rows:
        cols = [cells.get((row, k)) for k in kinds]
        lines.append(f"| {row} | " + " | ".join(f"{c[0]}/{c[1]}" if c else "" for c in cols) + " |")
    lines += ["", "| check | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for check in CHECKS:
        counts = [by_check.get((check, k), 0) for k in kinds]
        lines.append(f"| {check} | " + " | ".join(str(c) for c in counts) + " |")
    lines += ["", "Violating runs:", ""]
    lines += [f"- {r.label}: {', '.join(r.broken)}" for r in reports if r.violations]
    summary = {
        "runs": len(reports),
        "violating_runs": sum(bool(r.violations) for r in reports),
        "cells": {f"{row} x {kind}": v for (row, kind), v in sorted(cells.items())},
        "checks": {f"{c} x {k}": n for (c, k), n in sorted(by_check.items())},
        "reports": [report_as_json(r) for r in reports],
    }
    return summary, "\n".join(lines) + "\n"


def report_as_json(report: RunReport) -> dict[str, Any]:
    data = asdict(report)
    data["broken"] = report.broken
    return data


def write_summary(reports: list[RunReport], path: str | os.PathLike[str]) -> str:
    """Write ``<path>.json`` and ``<path>.md`` (``path`` without a suffix); return the table."""
    summary, table = summarize(reports)
    base = Path(path)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str))
    base.with_suffix(".md").write_text(table)
    return table


def fresh_dir(parent: Path, seed: int) -> Path:
    path = parent / f"seed{seed}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    return path
