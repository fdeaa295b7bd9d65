"""Seeded chaos runs of ``CheckpointManager`` on real gloo ranks: the driver.

:func:`run_chaos` plays the scenario of a seed (:mod:`e2e._chaos_plan`) in two phases on real
components: spawned gloo ranks (:func:`dcp_safe.testing.multiproc.run_ranks`), real files, a
moto S3 server on 127.0.0.1 behind :class:`dcp_safe.testing.s3_proxy.FaultProxy`, real signals
and resource limits.

1. **faulty phase** (:func:`faulty_phase` on every rank): each rank builds its manager with the
   same arguments and runs a training loop of ``steps`` requests (a DTensor state updated in
   place, ``maybe_save`` each step), while the faults strike; then ``close()``. The loop goes on
   through errors, as a job whose ranks are all alive would, except in a scenario that loses a
   rank: there, like a job whose peer died, a rank stops at the first error it sees.
2. **restart phase** (:func:`restart_phase`): a new job attempt on the same roots (a higher
   ``attempt`` and ``TORCHELASTIC_RESTART_COUNT``, sometimes another world size) restores the
   newest checkpoint, checks it, and saves the next two steps, as a restarted job resumes from
   the step it restored (so it saves again the names a crash left half-written).

How faults are made: in-write faults by :class:`ChaosWriter` (a writer whose ``_write_item``
sleeps, or sends its own process SIGKILL or SIGSTOP); ``slow_follow_up`` by giving rank 0's
checkpoint backend slow deletes; ``fsize`` by ``setrlimit(RLIMIT_FSIZE)`` in the rank with
SIGXFSZ ignored; ``storage_error`` by a ``faulty://`` root whose injector fails the victim's
writes; parent-timed faults (``kill_timer``, every ``s3_*``) by a thread of the parent, once
every rank announced its loop. Every wait in the rank bodies is bounded, and each phase runs
under a bound (:meth:`Scenario.bound_s`): a rank still running then is a hang.

The default path (``Scenario.default_path``): each rank builds its manager as a user does,
with no ``writer=`` or ``stager=``, so its saves run in its checkpoint worker process; the
ranks are launched as ``torchrun`` launches them (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``, a ``TCPStore`` rendezvous). Its faults are struck from the parent
(:func:`_strike`): signals to a rank, or to its worker found as the rank's child process
(:func:`workers_of`), the start-up kills by a thread that polls for the
worker's appearance. There, and on the writer's path alike, :class:`ProcessWatch` records
every rank and worker process of the phase, so that the checks can tell whether one outlived
its rank or the job; each rank records, per save request, how long the call took and whether
its worker was ready, and the synchronous save of the same state it measured first
(:func:`_sync_save_s`), for the check that no request waits on a worker's start-up.

Then the checks of :mod:`e2e._chaos_checks` read what the ranks returned and what the roots
hold. Rank bodies are module-level functions, so ``run_ranks`` pickles them by reference.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import resource
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from e2e._chaos_checks import (
    Phase,
    Roots,
    RunReport,
    check_after_faults,
    check_loss,
    check_phase,
    check_restart,
    check_roots,
    report_as_json,
)
from e2e._chaos_plan import (
    RESTART_SAVES,
    STARTUP_KINDS,
    Fault,
    Scenario,
    blank_sharded,
    differences,
    scenario_for,
    sharded_state,
    step_of,
    update_in_place,
)
from torch.distributed.device_mesh import init_device_mesh

import dcp_safe
from dcp_safe import (
    Bounds,
    CheckpointManager,
    CommitError,
    DcpSafeError,
    MemoryBudget,
    Resume,
    Runtime,
    SafeStorageWriter,
    SavePolicy,
    Topology,
)
from dcp_safe.adapters.node_local import NodeLocalWriter
from dcp_safe.checkpoints.history import HISTORY_FILE
from dcp_safe.testing import multiproc
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
from dcp_safe.testing.multiproc import RankFailedError, RanksTimeoutError, run_ranks
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy
from dcp_safe.topology import Root

__all__ = [
    "ChaosNodeLocalWriter",
    "ChaosWriter",
    "Job",
    "ProcessWatch",
    "build_manager",
    "workers_of",
    "faulty_phase",
    "restart_phase",
    "run_chaos",
]

KEEP_LAST = 2
RANKS_PER_NODE = 2  # node_local: ranks 0-1 share node 0's directory, 2-3 node 1's
_FSIZE_LIMIT_BYTES = 512  # below one rank's shard file: its writes fail with EFBIG
# How long a process of the job may outlive its rank (a worker) or the job (any), and a closed
# manager keep its worker: the worker's own watch of its parent polls well within it.
OUTLIVE_GRACE_S = 5.0
_WATCH_POLL_S = 0.1
_STARTUP_POLL_S = 0.01  # a worker imports torch for a second or more: caught long before


@dataclass(frozen=True)
class Job:
    """What the ranks of one phase need to know (it pickles into every rank).

    Attributes:
        scenario: the run.
        phase: ``"faulty"`` or ``"restart"``.
        attempt: the job attempt (0 for the faulty phase, 1 for the restart).
        root: the checkpoint root each manager is given (local path, ``faulty://`` URL or the
            S3 root of a node-local run).
        replica: ``replicate_to`` (or None).
        s3_options: options for the S3 root or replica (through the fault proxy in the faulty
            phase).
        node_dirs: node-local caches, one per simulated node.
        run_dir: scratch space of the run (pid files).
        expect_restore: the name the restart must restore (the newest listed), or None.
    """

    scenario: Scenario
    phase: str
    attempt: int
    root: str
    replica: str | None
    s3_options: dict[str, Any] | None
    node_dirs: tuple[str, ...]
    run_dir: str
    expect_restore: str | None = None


# -- in-rank faults -----------------------------------------------------------------------------


class _ChaosHooks:
    """Mixed into the writer: this rank's faults that strike inside a save.

    ``die_from``/``stop_from``: SIGKILL/SIGSTOP this process after the first item written by
    the first save at or after that step. ``slow_s`` from ``slow_from``: a sleep before each
    item (storage held slow on this rank).
    """

    die_from: int | None = None
    stop_from: int | None = None
    slow_from: int | None = None
    slow_s: float = 0.0
    step: int | None

    def _write_item(self, sink: Any, file_name: str, item: Any, planner: Any) -> Any:
        step = self.step or 0
        if self.slow_from is not None and step >= self.slow_from:
            time.sleep(self.slow_s)
        record = super()._write_item(sink, file_name, item, planner)  # type: ignore[misc]
        if self.die_from is not None and step >= self.die_from:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop_from is not None and step >= self.stop_from:
            self.stop_from = None
            os.kill(os.getpid(), signal.SIGSTOP)
        return record


class ChaosWriter(_ChaosHooks, SafeStorageWriter):
    """A :class:`SafeStorageWriter` with :class:`_ChaosHooks`."""


class ChaosNodeLocalWriter(_ChaosHooks, NodeLocalWriter):
    """A :class:`NodeLocalWriter` with :class:`_ChaosHooks`."""


def _slow_deletes(backend: Any, delay_s: float) -> None:
    """Make ``backend.remove_tree`` sleep first: storage whose deletes are slow, so retention
    (and whatever else of the follow-up deletes) outlasts the deadline. The object keeps its
    class's behaviour otherwise (a subclass, so type checks still hold)."""
    base = type(backend)

    def remove_tree(self: Any, rel: str) -> None:
        time.sleep(delay_s)
        base.remove_tree(self, rel)

    backend.__class__ = type(f"SlowDeletes{base.__name__}", (base,), {"remove_tree": remove_tree})


def _arm_writer(writer: _ChaosHooks, scenario: Scenario, rank: int) -> None:
    for fault in scenario.faults:
        mine = fault.rank in (rank, -1)
        if fault.kind in ("kill_rank", "kill_all") and mine:
            writer.die_from = fault.step
        elif fault.kind == "stop_rank" and mine:
            writer.stop_from = fault.step
        elif fault.kind == "slow_rank" and mine:
            writer.slow_from, writer.slow_s = fault.step, fault.seconds


def _fill_disk(limit_bytes: int) -> int:
    """RLIMIT_FSIZE: from now on no write of this process may grow a file past the limit.
    SIGXFSZ is ignored, so such a write fails with EFBIG instead of killing the process.
    Returns the soft limit it replaced (to lift it with :func:`_free_disk`)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    return soft


def _free_disk(soft: int) -> None:
    """Lift the limit :func:`_fill_disk` set: the disk has room again."""
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _root_options(job: Job, rank: int) -> dict[str, Any] | None:
    """The local root's storage options: a fault injector for ``faulty://`` roots."""
    if not job.scenario.faulty_root:
        return None
    fault = job.scenario.fault("storage_error")
    plan = FaultPlan()
    if job.phase == "faulty" and fault is not None and fault.rank == rank:
        plan = FaultPlan(
            fail_at=fault.count,
            ops=("write",),
            error=fault.error,
            persistent=fault.persistent,
            seed=job.scenario.seed,
        )
    return {"target_protocol": "file", "faults": FaultInjector(plan)}


def build_manager(job: Job, rank: int) -> CheckpointManager:
    """This rank's manager for ``job``: with the writer carrying its faults, or on the default
    path as a user builds it (no ``writer=``, no ``stager=``)."""
    scenario = job.scenario
    writer: SafeStorageWriter
    options = _root_options(job, rank)
    node = job.node_dirs[rank // RANKS_PER_NODE] if scenario.roots == "node_local" else None
    policy = SavePolicy(when_busy=scenario.when_busy, staging=scenario.staging)
    bounds = Bounds(
        budget=MemoryBudget(usable_bytes=256 << 20, reserve_bytes=0),
        deadline_s=scenario.deadline_s,
        wait_timeout_s=scenario.wait_timeout_s,
    )
    resume = Resume(attempt=job.attempt)
    if scenario.default_path:
        topology = Topology.of(
            job.root,
            replicate_to=job.replica,
            # Local paths take no options: the S3 root's or replica's are the only ones.
            storage_options=job.s3_options if scenario.roots != "local" else options,
            node_local=node,
        )
        return CheckpointManager(
            topology, keep_last=KEEP_LAST, policy=policy, bounds=bounds, resume=resume
        )
    if node is not None:
        writer = ChaosNodeLocalWriter(
            node, remote=Root(job.root, job.s3_options), attempt=job.attempt
        )
    else:
        writer = ChaosWriter(
            job.root,
            storage_options=options,
            replicate_to=None if job.replica is None else Root(job.replica, job.s3_options),
            attempt=job.attempt,
        )
    if job.phase == "faulty":
        _arm_writer(writer, scenario, rank)
        slow = scenario.fault("slow_follow_up")
        if slow is not None and rank == 0:
            pruned = writer.remote if scenario.roots == "node_local" else writer.backend
            _slow_deletes(pruned, slow.seconds)
    # The writer carries the topology (its roots, their options, the node cache).
    return CheckpointManager(
        job.root,
        keep_last=KEEP_LAST,
        policy=policy,
        bounds=bounds,
        resume=resume,
        runtime=Runtime(writer=writer),
    )


# -- what a rank records ------------------------------------------------------------------------


def describe_error(exc: BaseException, where: str, step: int | None) -> dict[str, Any]:
    """An error as plain data: where it reached the caller, its type, and (CommitError) its
    per-rank failures."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CommitError) else None
    return {
        "where": where,
        "step": step,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "typed": isinstance(exc, DcpSafeError),
        "commit_error": isinstance(exc, CommitError),
        "failures": {int(k): str(v)[:200] for k, v in dict(failures or {}).items()},
        "message": str(exc)[:400],
    }


@dataclass
class _Record:
    """One rank's account of a phase."""

    rank: int
    outcomes: dict[int, str] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    handles: dict[int, Any] = field(default_factory=dict)
    seen: set[tuple[int, str]] = field(default_factory=set)
    replication_pending: list[int] = field(default_factory=list)
    # Per save request: its step, how long the call took, whether the worker was ready, when.
    requests: list[dict[str, Any]] = field(default_factory=list)
    sync_s: float | None = None  # the synchronous save of the same state, measured first

    def error(self, exc: BaseException, where: str, step: int | None) -> None:
        self.errors.append(describe_error(exc, where, step))

    def failed_handles(self) -> bool:
        """Poll the handles: record (once) each failure; True when any failed."""
        failed = False
        for step, handle in self.handles.items():
            for kind in ("committed", "replicated"):
                future: Future[Any] = getattr(handle, kind)
                if not future.done() or future.cancelled() or (step, kind) in self.seen:
                    continue
                error = future.exception()
                if error is not None and type(error).__name__ != "ReplicationSkippedError":
                    self.seen.add((step, kind))
                    self.error(error, kind, step)
                    failed = True
        return failed

    def settle(self) -> None:
        """Each requested step's outcome, once the manager is closed."""
        self.failed_handles()
        for step, handle in self.handles.items():
            if not handle.replicated.done():
                self.replication_pending.append(step)
            future = handle.committed
            if not future.done():
                self.outcomes[step] = "pending"
            elif future.cancelled():
                self.outcomes[step] = "cancelled"
            else:
                self.outcomes[step] = "committed" if future.exception() is None else "failed"

    def as_dict(self, manager: CheckpointManager | None, **extra: Any) -> dict[str, Any]:
        decisions = manager.decisions() if manager is not None else []
        history: list[dict[str, Any]] = []
        if manager is not None and self.rank == 0:
            try:
                history = manager.history()
            except Exception as exc:
                self.error(exc, "history", None)
        stats = manager.stats() if manager is not None else None
        return {
            "rank": self.rank,
            "outcomes": dict(self.outcomes),
            "replication_pending": list(self.replication_pending),
            "errors": list(self.errors),
            "decisions": [(e["event"], e["step"], e.get("tier")) for e in decisions],
            "history": [(e["event"], e.get("name"), e.get("tier")) for e in history],
            "executor": None if manager is None else manager.executor,
            "requests": list(self.requests),
            "sync_s": self.sync_s,
            "fallback": None if stats is None else stats.fallback_reason,
            # A closed manager leaves no worker behind (a stopped one included).
            "workers_after_close": _workers_left(OUTLIVE_GRACE_S),
            **extra,
        }


def _workers_left(grace_s: float) -> list[int]:
    """This process's checkpoint workers still alive after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while (left := workers_of(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _worker_ready(manager: CheckpointManager) -> bool | None:
    """Whether the manager's checkpoint worker can save now (``None``: it has none, a thread
    saves)."""
    worker = manager._runner.worker
    return None if worker is None else bool(getattr(worker, "ready", False))


def _sync_save_s(job: Job, rank: int, state: dict[str, Any]) -> float | None:
    """How long a synchronous save of ``state`` takes here, to a scratch root of the run's kind
    (a node cache uploading to S3 for node-local runs): what a save request is compared with.
    Every rank calls it (a collective save); ``None`` if it failed."""
    probe = f"probe_{job.phase}"
    writer: SafeStorageWriter
    if job.scenario.roots == "node_local":
        node = f"{job.node_dirs[rank // RANKS_PER_NODE]}_{probe}"
        remote = f"{job.root.rsplit('/', 1)[0]}/{probe}"
        writer = NodeLocalWriter(node, remote=Root(remote, job.s3_options))
    else:
        writer = SafeStorageWriter(str(Path(job.run_dir) / probe))
    started = time.monotonic()
    try:
        dcp_safe.save(state, checkpoint_id="probe", storage_writer=writer)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            writer.close()
    return time.monotonic() - started


def _close(manager: CheckpointManager, record: _Record, timeout_s: float) -> None:
    try:
        manager.close(timeout_s=timeout_s)
    except BaseException as exc:
        record.error(exc, "close", None)


def _pass_interrupts(exc: BaseException) -> None:
    """A rank body records whatever a manager call raises instead of dying with it (DCP's
    ``CheckpointException`` is a ``BaseException``), except an interrupt of the harness."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc


def _manager_or_none(job: Job, rank: int, record: _Record) -> CheckpointManager | None:
    try:
        return build_manager(job, rank)
    except BaseException as exc:
        _pass_interrupts(exc)
        record.error(exc, "CheckpointManager()", None)
        return None


def _register(job: Job, rank: int) -> None:
    """Tell the parent this rank's pid (before its manager may start a worker)."""
    path = Path(job.run_dir) / f"{job.phase}_rank{rank}.pid"
    path.write_text(str(os.getpid()))


def _announce(job: Job, rank: int) -> None:
    """Tell the parent that this rank's loop starts (parent-timed faults count from there)."""
    (Path(job.run_dir) / f"{job.phase}_rank{rank}.loop").write_text("")


# -- the rank bodies ----------------------------------------------------------------------------


def faulty_phase(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """The training loop under faults: ``steps`` save requests, then ``close()``.

    The loop goes on through errors, as a job whose ranks are all alive would, except when the
    scenario loses a rank: then, like a job whose peer died, it stops at the first error seen.
    """
    scenario = job.scenario
    _register(job, rank)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(job.attempt)
    mesh = init_device_mesh("cpu", (world_size,))
    state = sharded_state(mesh, 0)
    record = _Record(rank)
    record.sync_s = _sync_save_s(job, rank, state)
    manager = _manager_or_none(job, rank, record)
    if manager is None:
        return record.as_dict(None)
    fsize = scenario.fault("fsize")
    _announce(job, rank)
    soft = None
    for step in range(1, scenario.steps + 1):
        if fsize is not None and fsize.rank == rank and step == fsize.step:
            soft = _fill_disk(_FSIZE_LIMIT_BYTES)
        if fsize is not None and soft is not None and step == fsize.count:
            _free_disk(soft)
        if _save_one(manager, record, state, step, rank, world_size) and scenario.loses_a_rank:
            break
        time.sleep(scenario.step_s)
        if record.failed_handles() and scenario.loses_a_rank:
            break
    _close(manager, record, timeout_s=4 * scenario.deadline_s + _slowness(scenario))
    record.settle()
    return record.as_dict(manager)


def _slowness(scenario: Scenario) -> float:
    return sum(f.seconds for f in scenario.faults if f.kind in ("slow_follow_up", "s3_outage"))


def _save_one(
    manager: CheckpointManager,
    record: _Record,
    state: dict[str, Any],
    step: int,
    rank: int,
    world_size: int,
) -> bool:
    """Update the state to ``step`` (after its previous copy, with overlap) and request a save,
    recording how long the request took and whether the worker was ready then. True when a
    manager call raised."""
    try:
        if manager.staging.value == "overlap":
            manager.wait_staged(timeout_s=4 * manager.deadline_s)
        update_in_place(state, step, rank, world_size)
        ready, at = _worker_ready(manager), time.monotonic()
        try:
            handle = manager.maybe_save(step, state)
        finally:
            stall = time.monotonic() - at
            record.requests.append({"step": step, "stall_s": stall, "ready": ready, "at": at})
    except BaseException as exc:
        _pass_interrupts(exc)
        record.error(exc, "maybe_save", step)
        record.outcomes[step] = "raised"
        return True
    if handle is None:
        record.outcomes[step] = "skipped"
    else:
        record.handles[step] = handle
    return False


def restart_phase(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """The restarted job: restore the newest checkpoint, check it, save the next two steps."""
    scenario = job.scenario
    _register(job, rank)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(job.attempt)
    mesh = init_device_mesh("cpu", (world_size,))
    record = _Record(rank)
    record.sync_s = _sync_save_s(job, rank, sharded_state(mesh, 0))
    manager = _manager_or_none(job, rank, record)
    if manager is None:
        return record.as_dict(None, restored=None, wrong=[], committed=[])
    restored, wrong, start = None, [], 0
    if job.expect_restore is not None:
        target = blank_sharded(mesh)
        try:
            restored = manager.restore(target)
            start = step_of(restored)
            wrong = differences(target, start, rank, world_size)
        except BaseException as exc:
            _pass_interrupts(exc)
            record.error(exc, "restore", None)
    state = sharded_state(mesh, start)
    committed = []
    for step in range(start + 1, start + 1 + RESTART_SAVES):
        if _save_one(manager, record, state, step, rank, world_size):
            break
        handle = record.handles.get(step)
        if handle is not None:
            with contextlib.suppress(Exception):
                committed.append(handle.committed.result(timeout=4 * scenario.deadline_s))
    _close(manager, record, timeout_s=4 * scenario.deadline_s)
    record.settle()
    return record.as_dict(manager, restored=restored, wrong=wrong, committed=committed)


def run_chaos(
    seed: int,
    base_dir: Path,
    s3: LocalS3 | None,
    *,
    long_mode: bool = False,
    default_path: bool | None = None,
) -> RunReport:
    """Play ``scenario_for(seed)`` and check every invariant; never raises for a violation.

    Args:
        seed: the run's seed.
        base_dir: an empty directory for the run's roots and scratch files.
        s3: the moto server (needed by runs with an S3 root or replica; others may pass None).
        long_mode: draw from the long mode's variants (world size 4 too).
        default_path: force the path (``None``: drawn from the seed).
    """
    scenario = scenario_for(seed, long_mode=long_mode, default_path=default_path)
    report = RunReport(
        seed=seed,
        variant=scenario.variant,
        faults=tuple(f.kind for f in scenario.faults),
        label=scenario.label,
    )
    started = time.monotonic()
    roots = _make_roots(scenario, base_dir, s3)
    with contextlib.ExitStack() as stack:
        proxy = None
        if roots.s3 is not None:
            proxy = stack.enter_context(FaultProxy(roots.s3.endpoint_url))
        first = _run_faulty_phase(scenario, roots, base_dir, proxy, report)
    check_phase(scenario, first, report, restart=False)
    check_loss(scenario, first, report)
    newest_listed = check_after_faults(roots, first, report)
    second = _run_restart_phase(scenario, roots, base_dir, newest_listed)
    check_phase(scenario, second, report, restart=True)
    check_restart(scenario, second, newest_listed, report)
    check_roots(roots, [first, second], report)
    report.notes += [
        _paths(name, phase) for name, phase in (("faulty", first), ("restart", second))
    ]
    report.seconds = time.monotonic() - started
    _keep_record(base_dir, report, {"faulty": first, "restart": second})
    return report


def _paths(name: str, phase: Phase) -> str:
    """What a phase's ranks ran their saves on, and their longest request made while the
    worker was not ready, against their synchronous save (for the campaign's notes)."""
    results = phase.results.values()
    executors = sorted({str(r.get("executor")) for r in results})
    cold = [q["stall_s"] for r in results for q in r.get("requests", []) if q["ready"] is False]
    sync = [r["sync_s"] for r in results if r.get("sync_s")]
    return (
        f"{name}: executor {'/'.join(executors)}, {len(cold)} requests before a worker was"
        f" ready (longest {max(cold, default=0):.2f} s), sync save {max(sync, default=0):.2f} s"
    )


def _keep_record(base_dir: Path, report: RunReport, phases: dict[str, Phase]) -> None:
    """What every rank returned, next to the run's roots, for a post-mortem."""
    record = {"report": report_as_json(report), "phases": {k: asdict(v) for k, v in phases.items()}}
    (base_dir / "chaos_run.json").write_text(json.dumps(record, indent=1, default=str))


def _make_roots(scenario: Scenario, base_dir: Path, s3: LocalS3 | None) -> Roots:
    needs_s3 = scenario.roots in ("replica", "node_local")
    if needs_s3 and s3 is None:
        raise ValueError(f"seed {scenario.seed} needs the S3 server ({scenario.roots})")
    bucket = s3.create_bucket() if needs_s3 and s3 is not None else None
    local = str(base_dir / "root")
    if scenario.faulty_root:
        local = f"faulty://{local}"
    nodes = tuple(str(base_dir / f"node{n}") for n in range(2))
    if scenario.roots == "node_local":
        return Roots(f"s3://{bucket}/run", None, nodes, bucket, s3)
    replica = f"s3://{bucket}/run" if scenario.roots == "replica" else None
    return Roots(local, replica, (), bucket, s3 if needs_s3 else None)


def _job(scenario: Scenario, roots: Roots, base_dir: Path, phase: str, **extra: Any) -> Job:
    return Job(
        scenario=scenario,
        phase=phase,
        attempt=0 if phase == "faulty" else 1,
        root=roots.root,
        replica=roots.replica,
        s3_options=extra.pop("s3_options", None),
        node_dirs=roots.node_dirs,
        run_dir=str(base_dir),
        **extra,
    )


@dataclass
class _Seen:
    """A process of the job the watch saw: a rank or one of its checkpoint workers."""

    rank: int
    kind: str  # "rank" or "worker"
    process: psutil.Process
    outlived: bool = False  # already reported

    def alive(self) -> bool:
        """Running (a stopped process too), neither gone nor a zombie; never another process
        that got its pid since (psutil compares the creation time)."""
        try:
            return self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


class ProcessWatch:
    """Every rank and checkpoint worker process of one phase, as the parent sees them.

    A thread polls the ranks (their pid files) and their workers (their child processes) until
    :meth:`finish`. ``outlived`` says what broke "no process of the job outlives it": a worker
    alive :data:`OUTLIVE_GRACE_S` after its rank died, while the phase runs; after the phase,
    any process of it still alive after that grace (``run_ranks`` kills each rank's process
    group: a process that left it, or survived that, is one a job leaves behind).
    """

    def __init__(self, job: Job, world_size: int) -> None:
        self.job = job
        self.world_size = world_size
        self.seen: dict[int, _Seen] = {}
        self.rank_died: dict[int, float] = {}
        self.outlived: list[str] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-watch", daemon=True)
        self._thread.start()

    def rank_pid(self, rank: int) -> int | None:
        path = Path(self.job.run_dir) / f"{self.job.phase}_rank{rank}.pid"
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
        return None

    def workers(self, rank: int) -> list[int]:
        """The live checkpoint workers of ``rank`` now (recorded as seen)."""
        pid = self.rank_pid(rank)
        if pid is None:
            return []
        try:
            found = workers_of(pid)
        except OSError:
            return []
        for worker in found:
            self._track(rank, "worker", worker)
        return found

    def _track(self, rank: int, kind: str, pid: int) -> _Seen | None:
        with self.lock:
            if pid in self.seen and self.seen[pid].alive():
                return self.seen[pid]
            try:
                self.seen[pid] = _Seen(rank, kind, psutil.Process(pid))
            except psutil.Error:
                return None
            return self.seen[pid]

    def poll(self) -> None:
        now = time.monotonic()
        for rank in range(self.world_size):
            pid = self.rank_pid(rank)
            if pid is None:
                continue
            seen = self._track(rank, "rank", pid)
            if seen is not None and seen.alive():
                self.workers(rank)
            else:  # a zombie, or gone (reaped) already
                self.rank_died.setdefault(rank, now)
        with self.lock:
            orphans = [
                s
                for s in self.seen.values()
                if s.kind == "worker"
                and not s.outlived
                and now - self.rank_died.get(s.rank, now) > OUTLIVE_GRACE_S
                and s.alive()
            ]
        for orphan in orphans:
            orphan.outlived = True
            self.outlived.append(
                f"rank {orphan.rank}'s checkpoint worker (pid {orphan.process.pid},"
                f" {_state(orphan.process)}) still ran {OUTLIVE_GRACE_S:g} s after its rank died"
            )

    def _run(self) -> None:
        while not self._stop.wait(_WATCH_POLL_S):
            self.poll()

    def settle(self) -> None:
        """Wait until every worker of a dead rank is gone or reported (at most the grace)."""
        while True:
            self.poll()
            with self.lock:
                waiting = [
                    s
                    for s in self.seen.values()
                    if s.kind == "worker" and s.rank in self.rank_died and not s.outlived
                ]
            if not any(s.alive() for s in waiting):
                return
            time.sleep(0.05)

    def finish(self) -> None:
        """After the phase: every process seen must be gone within the grace."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + OUTLIVE_GRACE_S
        while (left := [s for s in self.seen.values() if s.alive()]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        for seen in left:
            if not seen.outlived:  # not reported while the phase ran
                self.outlived.append(
                    f"rank {seen.rank}'s {seen.kind} (pid {seen.process.pid},"
                    f" {_state(seen.process)}) still ran {OUTLIVE_GRACE_S:g} s after the"
                    f" {self.job.phase} phase ended"
                )
            with contextlib.suppress(psutil.Error):
                seen.process.kill()  # the next run must not inherit it


_WORKER_COMMAND = re.compile(rb"dcp_safe[./]worker[./](boot|main)")


def workers_of(pid: int) -> list[int]:
    """The checkpoint workers among the children of ``pid`` (of any of its threads), read from
    ``/proc``: cheap enough to poll every few milliseconds on a loaded host."""
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):
            for child in Path(task).read_text().split():
                with contextlib.suppress(OSError):
                    if _WORKER_COMMAND.search(Path(f"/proc/{child}/cmdline").read_bytes()):
                        found.append(int(child))
    return found


def _state(process: psutil.Process) -> str:
    try:
        return f"state {process.status()}, parent {process.ppid()}"
    except psutil.Error:
        return "gone"


def _run_faulty_phase(
    scenario: Scenario,
    roots: Roots,
    base_dir: Path,
    proxy: FaultProxy | None,
    report: RunReport,
) -> Phase:
    options = proxy.storage_options() if proxy is not None else None
    job = _job(scenario, roots, base_dir, "faulty", s3_options=options)
    stop = threading.Event()
    watch = ProcessWatch(job, scenario.world_size)
    struck: dict[str, float] = {}
    timers = [
        threading.Thread(
            target=_strike, args=(fault, job, proxy, stop, report, watch, struck), daemon=True
        )
        for fault in scenario.faults
        if fault.from_parent
    ]
    for timer in timers:
        timer.start()
    try:
        phase = _run_phase(faulty_phase, job, scenario.world_size, watch)
    finally:
        stop.set()
        for timer in timers:
            timer.join(timeout=30)
        if proxy is not None:
            proxy.clear()
        watch.finish()
    phase.outlived, phase.struck = watch.outlived, struck
    return phase


def _strike(
    fault: Fault,
    job: Job,
    proxy: FaultProxy | None,
    stop: threading.Event,
    report: RunReport,
    watch: ProcessWatch,
    struck: dict[str, float],
) -> None:
    """A parent's fault: the start-up kinds the moment the victim's worker appears; the others
    once every rank's loop started and ``at_s`` passed. ``struck``: when, by kind."""
    ranks = range(job.scenario.world_size)
    loops = [Path(job.run_dir) / f"{job.phase}_rank{r}.loop" for r in ranks]
    deadline = time.monotonic() + job.scenario.bound_s(job.scenario.world_size)
    if fault.kind in STARTUP_KINDS:
        _strike_at_startup(fault, watch, stop, deadline, report, struck)
        return
    while not all(p.exists() for p in loops):
        if stop.wait(0.05) or time.monotonic() > deadline:
            return
    if stop.wait(fault.at_s):
        return
    pids = [watch.rank_pid(r) or 0 for r in ranks]
    if fault.kind in ("kill_timer", "kill_all", "stop_timer"):
        victims = list(ranks) if fault.rank < 0 else [fault.rank]
        signum = signal.SIGSTOP if fault.kind == "stop_timer" else signal.SIGKILL
        hit = [v for v in victims if _signal_child(pids[v], os.getpid(), signum)]
        struck[fault.kind] = time.monotonic()
        report.notes.append(f"{signal.Signals(signum).name} to rank(s) {hit} of {victims}")
        return
    if fault.kind in ("kill_worker", "stop_worker"):
        signum = signal.SIGSTOP if fault.kind == "stop_worker" else signal.SIGKILL
        while not stop.is_set() and time.monotonic() < deadline:
            workers = watch.workers(fault.rank)
            if workers and _signal_child(workers[0], pids[fault.rank], signum):
                struck[fault.kind] = time.monotonic()
                name = signal.Signals(signum).name
                report.notes.append(f"{name} to rank {fault.rank}'s worker {workers[0]}")
                return
            stop.wait(0.05)  # no worker yet: the first save starts it
        return
    assert proxy is not None, fault
    if fault.kind == "s3_error":
        proxy.fail(503, "SlowDown", method="PUT", times=fault.count)
    elif fault.kind == "s3_delay":
        proxy.delay(fault.seconds, times=fault.count)
    elif fault.kind == "s3_history_error":
        proxy.fail(403, "AccessDenied", method="PUT", key=HISTORY_FILE, times=None)
    elif fault.kind == "s3_outage":
        outage = proxy.fail(503, "ServiceUnavailable", times=None)
        stop.wait(fault.seconds)
        outage.times = 0  # disarmed: the service is back


def _strike_at_startup(
    fault: Fault,
    watch: ProcessWatch,
    stop: threading.Event,
    deadline: float,
    report: RunReport,
    struck: dict[str, float],
) -> None:
    """Kill the victim's worker (``count`` start-ups in a row), or the victim rank itself, the
    moment its worker process appears: long before that worker could import anything."""
    killed: set[int] = set()
    while not stop.is_set() and time.monotonic() < deadline:
        rank_pid = watch.rank_pid(fault.rank)
        new = [w for w in watch.workers(fault.rank) if w not in killed] if rank_pid else []
        if not new:
            time.sleep(_STARTUP_POLL_S)
            continue
        if fault.kind == "kill_rank_startup":
            if _signal_child(rank_pid or 0, os.getpid(), signal.SIGKILL):
                struck[fault.kind] = time.monotonic()
                report.notes.append(f"SIGKILL to rank {fault.rank} as worker {new[0]} appeared")
            return
        killed.add(new[0])
        if _signal_child(new[0], rank_pid or 0, signal.SIGKILL):
            struck[fault.kind] = time.monotonic()
            report.notes.append(f"SIGKILL to rank {fault.rank}'s worker {new[0]} as it appeared")
            if len(killed) >= max(1, fault.count):
                return


def _signal_child(pid: int, parent: int, signum: int) -> bool:
    """Send ``signum`` to ``pid`` if it is still a child of ``parent`` (a rank of this process
    not yet reaped, a worker of a rank); never to another process that got its number since.
    The pidfd pins the process that was checked."""
    try:
        pidfd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid"))
        if int(ppid) != parent:
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except (OSError, StopIteration, ValueError):
        return False
    finally:
        os.close(pidfd)


def _run_phase(body: Any, job: Job, world_size: int, watch: ProcessWatch) -> Phase:
    """Run ``body`` on ``world_size`` ranks within the scenario's bound; whatever happens, the
    phase's outcome as the parent saw it."""
    bound = job.scenario.bound_s(world_size)
    started = time.monotonic()
    # run_ranks ends by killing each rank's process group, its workers with it: first, each
    # worker of a dead rank gets its grace to go by itself (or is reported), as under a
    # launcher that kills no process group (torchrun's agent signals its ranks only).
    kill_all = multiproc._kill_all
    multiproc._kill_all = lambda procs: (watch.settle(), kill_all(procs))  # type: ignore[assignment]
    try:
        results = run_ranks(
            body, world_size, args=(job,), timeout_s=bound, failure_grace_s=bound / 2
        )
        phase = Phase(dict(enumerate(results)))
    except RankFailedError as exc:
        phase = Phase(dict(exc.results), failures=dict(exc.failures))
    except RanksTimeoutError as exc:
        phase = Phase(dict(exc.results), timed_out=exc.ranks)
    finally:
        multiproc._kill_all = kill_all  # type: ignore[assignment]
    phase.seconds = round(time.monotonic() - started, 1)
    return phase


def _run_restart_phase(
    scenario: Scenario, roots: Roots, base_dir: Path, newest: str | None
) -> Phase:
    options = roots.s3.storage_options() if roots.s3 is not None else None
    job = _job(scenario, roots, base_dir, "restart", s3_options=options, expect_restore=newest)
    watch = ProcessWatch(job, scenario.restart_world_size)
    try:
        phase = _run_phase(restart_phase, job, scenario.restart_world_size, watch)
    finally:
        watch.finish()
    phase.outlived = watch.outlived
    return phase
