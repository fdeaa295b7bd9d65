"""The manager's configuration as values: a few frozen option objects, each validated once.

``CheckpointManager(root, save_every=, keep_last=, when_busy=, policy=, retention=, bounds=,
resume=, runtime=)``: the root (a path, a URL or a :class:`~dcp_safe.topology.Topology`, which
carries the replica, the node cache, the peer copies and each root's fsspec options), three
shorthands a loop sets every time, and one object per concern. Each keyword the manager took
before this layout is a field of the same name in one of them (``save_every`` became
``SavePolicy.every``); :data:`MOVED` says where, and passing one raises a
:class:`~dcp_safe.errors.ConfigError` that says so (docs/manager.md, "Where each option went").
Each object validates its fields when built: a value out of range, a name pattern without a
usable ``{step}``, cadences that cannot combine or an unknown executor raise a ConfigError
naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from dcp_safe import layout
from dcp_safe.choices import parse_choice, require_int, seconds
from dcp_safe.coordination.group import DEFAULT_DEADLINE_S
from dcp_safe.coordination.worker_group import store_address
from dcp_safe.errors import ConfigError
from dcp_safe.manager.fallback import FallbackOptions
from dcp_safe.manager.handles import BusyPolicy, StagingMode, Validation
from dcp_safe.reading.safetensors_import import SafetensorsSource
from dcp_safe.retention.policy import (
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepWithin,
    RetentionPolicy,
    combine,
)
from dcp_safe.retention.sweeper import DEFAULT_GRACE_S
from dcp_safe.staging import BudgetedStager, MemoryBudget
from dcp_safe.torch_compat import default_store, rank_world

if TYPE_CHECKING:
    from dcp_safe.adapters.writer import SafeStorageWriter
    from dcp_safe.telemetry.recorder import Telemetry

Executor = Literal["thread", "process"]
EXECUTORS = ("auto", "thread", "process")

log = logging.getLogger("dcp_safe.manager")


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalizing a frozen dataclass's own field


@dataclass(frozen=True)
class SavePolicy:
    """When a save happens and how it is taken.

    Args:
        every: :meth:`~dcp_safe.CheckpointManager.maybe_save` saves when ``step % every == 0``.
        when_busy: see :class:`~dcp_safe.manager.BusyPolicy`.
        staging: see :class:`~dcp_safe.manager.StagingMode`.
        validate: see :class:`~dcp_safe.manager.Validation`.
        name_format: ``str.format`` pattern of checkpoint names, with ``{step}``.
        latency_objective_s: the oldest a save in flight may be; requests arriving later are
            skipped, with the reason recorded (``None``: not checked).
        sync_fallback: thresholds of the automatic switch to synchronous saves
            (docs/runbook.md).
        interval_s: of the steps ``every`` names, save one when at least this long has
            passed since the last committed save (or since the manager was built).
        continuous: of the steps ``every`` names, save one as soon as the previous save
            committed (on every rank), and no sooner than ``min_interval_s`` after it began.
        min_interval_s: see ``continuous`` (``None``: no minimum).
        first_step: also save at the first :meth:`~dcp_safe.CheckpointManager.maybe_save`.
        auto: choose the interval from a save's measured costs and the MTBF (docs/manager.md).
        mtbf_s: the job's mean time between failures (``None``: estimated from the history);
            ``auto`` and ``stats().expected_loss_per_hour_s`` use it.

    The timed cadences (``interval_s``, ``continuous``) are decided in one vote of every
    rank at each step ``every`` names, on the coordinator's clock (``Runtime.clock``; why:
    :mod:`dcp_safe.manager.cadence`), and never while a save is in flight.
    """

    every: int = 1
    when_busy: BusyPolicy | str = BusyPolicy.WAIT
    staging: StagingMode | str = StagingMode.SNAPSHOT
    validate: Validation | str = Validation.MANIFEST
    name_format: str = "step_{step:09d}"
    latency_objective_s: float | None = None
    sync_fallback: FallbackOptions = field(default_factory=FallbackOptions)
    interval_s: float | None = None
    continuous: bool = False
    min_interval_s: float | None = None
    first_step: bool = False
    auto: bool = False
    mtbf_s: float | None = None

    def __post_init__(self) -> None:
        require_int("save_every", self.every, 1)
        for flag in ("continuous", "first_step", "auto"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        for name in ("interval_s", "mtbf_s", "min_interval_s", "latency_objective_s"):
            if (value := getattr(self, name)) is not None:
                _set(self, name, seconds(name, value))
        if self.interval_s is not None and self.continuous:
            raise ConfigError("interval_s and continuous=True are two cadences: pick one")
        if self.auto and (self.interval_s is not None or self.continuous):
            raise ConfigError("auto=True chooses the interval: drop interval_s and continuous")
        if self.min_interval_s is not None and not self.continuous:
            raise ConfigError("min_interval_s bounds continuous=True saves: set continuous")
        choices = (("when_busy", BusyPolicy), ("staging", StagingMode), ("validate", Validation))
        for name, kind in choices:
            _set(self, name, parse_choice(kind, getattr(self, name), name))
        if not isinstance(self.sync_fallback, FallbackOptions):
            raise ConfigError(f"sync_fallback must be FallbackOptions, got {self.sync_fallback!r}")
        layout.format_name(self.name_format, 0)  # a bad pattern fails here, not at a save


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints stay, and how long a partial one is left alone.

    Args:
        keep_last: keep this many newest checkpoints (plus the safety rules of
            :mod:`dcp_safe.retention.policy`).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        keep_best: ``(k, metric, "min" | "max")``: also keep the ``k`` best checkpoints by the
            number their save recorded under ``metric`` (``save(..., metrics=)``).
        keep_within_s: also keep every checkpoint committed at most this long before the
            newest one.
        partial_grace_s: how old an unpublished save must be before a sweep removes it.
        trash_grace_s: how long a pruned checkpoint waits in the trash, restorable with
            ``dcp-safe gc --restore NAME``, before the coordinator deletes it in the
            background. 0 (the default): deleted at once, as the root's size was planned for
            ``keep_last``; a grace period holds every checkpoint pruned within it on top.
    """

    keep_last: int = 2
    keep_every: int | None = None
    keep_best: tuple[int, str, str] | None = None
    keep_within_s: float | None = None
    partial_grace_s: float = DEFAULT_GRACE_S
    trash_grace_s: float = 0.0

    def __post_init__(self) -> None:
        self.policy()  # each policy validates its own fields
        grace = self.partial_grace_s  # inf allowed: never swept
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ConfigError(f"partial_grace_s must be seconds >= 0 (or inf), got {grace!r}")
        seconds("trash_grace_s", self.trash_grace_s, zero_ok=True)

    def policy(self) -> RetentionPolicy:
        """The retention policy these options describe."""
        more: list[RetentionPolicy] = []
        if self.keep_every is not None:
            more.append(KeepEvery(self.keep_every))
        if self.keep_best is not None:
            if not isinstance(self.keep_best, tuple) or not 2 <= len(self.keep_best) <= 3:
                raise ConfigError(f"keep_best is (k, metric, 'min'|'max'): {self.keep_best!r}")
            more.append(KeepBest(*self.keep_best))  # type: ignore[arg-type]
        if self.keep_within_s is not None:
            more.append(KeepWithin(self.keep_within_s))
        return combine(KeepLast(self.keep_last), *more)


@dataclass(frozen=True)
class Bounds:
    """How much host memory a save may hold and how long anything may wait.

    Args:
        budget: the stager's memory budget (default: measured on this host, the writer's
            ``upload_buffer_bytes`` counted as another consumer; a budget given here should
            count them itself). Its envelope also bounds a restore's transient reads.
        deadline_s: how long any exchange may wait for a peer: a dead or hung peer fails the
            call with a CommitError. Ignored in a single process.
        wait_timeout_s: the longest a wait for the saves in flight lasts, and the bound of
            coalesced saves, restores and uploads (docs/multirank.md, "Every bound, in one
            place").
        exit_timeout_s: how long the drain at interpreter exit may take.
    """

    budget: MemoryBudget | None = None
    deadline_s: float = DEFAULT_DEADLINE_S
    wait_timeout_s: float = 600.0
    exit_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("deadline_s", "wait_timeout_s", "exit_timeout_s"):
            _set(self, name, seconds(name, getattr(self, name)))


@dataclass(frozen=True)
class Resume:
    """What a restart brings back, and from where.

    Args:
        per_rank: key prefixes (``"rng"``, ``"loader"``) of state saved once per rank and
            restored to its own rank; any other key that differs between ranks fails the save
            with :class:`~dcp_safe.errors.DivergentStateError` (docs/resume.md).
        initial_load_from: another run's root (its newest committed checkpoint) or
            ``ROOT/NAME``: what :meth:`~dcp_safe.CheckpointManager.restore` loads while this
            manager's roots hold no committed checkpoint (a warm start). Or Hugging Face
            weights: a :class:`~dcp_safe.manager.SafetensorsSource`, or the path of a model
            folder or of its ``model.safetensors[.index.json]`` (docs/resume.md).
        initial_load_keys: restore only these keys of the warm start.
        keep_in_memory: keep the last committed step's staged copy in host memory, inside the
            stager's envelope (which must hold two copies of the state), for ``rollback()``.
        attempt: this job attempt's number, for fencing stale writers (default: from
            ``TORCHELASTIC_RESTART_COUNT``).
    """

    per_rank: tuple[str, ...] = ()
    initial_load_from: str | os.PathLike[str] | SafetensorsSource | None = None
    initial_load_keys: tuple[str, ...] | None = None
    keep_in_memory: bool = False
    attempt: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.per_rank, str):
            raise ConfigError(f"per_rank must be a sequence of prefixes, got {self.per_rank!r}")
        _set(self, "per_rank", tuple(self.per_rank))
        if self.initial_load_keys is not None:
            _set(self, "initial_load_keys", tuple(self.initial_load_keys))
        if not isinstance(self.initial_load_from, SafetensorsSource | None):
            _set(self, "initial_load_from", os.fspath(self.initial_load_from))


@dataclass(frozen=True)
class Runtime:
    """Where saves run and the parts they run on (tests and embedders replace these).

    Args:
        executor: where a background save's write, commit and replication run: ``"process"``
            (a persistent worker process per rank, sharing the staged state), ``"thread"`` or
            ``"auto"`` (the default: the process where it applies, else the thread, the reason
            logged; docs/staging.md).
        writer: used instead of one built from the root (``"auto"`` keeps it on a thread).
        stager: used instead of one built here (not closed by ``close()``).
        telemetry: ``None`` records nothing. Not closed by ``close()``.
        memory_sampler: the node's available bytes at each request, against the budget's
            ``node_reserve`` (default: the lowest reading of a 1 s sampler since the last one).
        clock: monotonic seconds for the fallback's windows and latencies, and this rank's
            readings for a timed cadence (:mod:`dcp_safe.manager.cadence`).
        read_only: list, restore and follow the root without writing anything (an evaluation
            job beside training): no history line, no prune or sweep, no worker process;
            ``save``, ``maybe_save``, ``prune`` and ``install_preemption_handler`` raise
            ConfigError.
    """

    executor: str = "auto"
    writer: SafeStorageWriter | None = None
    stager: BudgetedStager | None = None
    telemetry: Telemetry | None = None
    memory_sampler: Callable[[], int | None] | None = None
    clock: Callable[[], float] = time.monotonic
    read_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.read_only, bool):
            raise ConfigError(f"read_only must be True or False, got {self.read_only!r}")
        if self.read_only:  # it saves nothing: no worker process to start
            _set(self, "executor", "thread")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")


def given(options: Any, **shorthands: Any) -> Any:
    """``options`` with each shorthand given (not ``None``) replacing its one field:
    ``keep_last=3, retention=Retention(keep_every=10)`` keeps both."""
    return dataclasses.replace(options, **{k: v for k, v in shorthands.items() if v is not None})


def choose_executor(
    executor: str,
    stager: BudgetedStager | None,
    writer: SafeStorageWriter,
    *,
    writer_given: bool,
) -> Executor:
    """The executor ``executor`` names (``writer_given``: the caller's writer, not the manager's).

    ``"auto"`` leaves a writer of the caller's on a thread: the worker would run a pickled copy
    of it, and whatever it does to objects of this process (counters, callbacks, events) would
    silently stop happening. ``"process"`` sends it all the same.

    ``"process"`` needs the same on every rank of a job (one platform, one store, one writer
    class), so the ranks choose alike; a job mixing executors would save over different groups.

    Raises:
        ConfigError: ``"process"`` where one of its needs does not hold (the message names it).
    """
    if executor == "thread":
        return "thread"
    unmet = _unmet_need(stager, writer, writer_given=writer_given and executor == "auto")
    if unmet is None:
        return "process"
    if executor == "process":
        raise ConfigError(unmet)
    log.info("executor='auto' chose 'thread': %s", unmet)
    return "thread"


def _unmet_need(
    stager: BudgetedStager | None, writer: SafeStorageWriter, *, writer_given: bool
) -> str | None:
    """What ``executor="process"`` needs and does not have here, in a sentence."""
    if writer_given:
        return "the writer is the caller's (executor='process' runs a copy of it)"
    if not hasattr(os, "memfd_create"):
        return "executor='process' needs os.memfd_create (Linux) for the slabs it shares"
    if stager is not None and stager.shared is None:
        return "executor='process' needs a stager built with shared_memory=True"
    if rank_world()[1] > 1:
        try:
            store_address(default_store())  # the workers meet there
        except ConfigError as exc:
            return str(exc)
    for backend in (writer.backend, writer.remote):
        if backend is not None and backend.process_local:
            return (
                f"executor='process' would write {backend.url} in its worker: that store lives"
                " in one process's memory, so this process would never see what it saved"
            )
    try:
        pickle.dumps(writer)  # what the worker is sent
    except Exception as exc:  # any reason it does not pickle is the answer
        return (
            f"executor='process' sends the writer to its worker pickled, and this"
            f" {type(writer).__name__} does not pickle ({exc!r}); use executor='thread'"
        )
    return None


_TOPOLOGY = "the root: CheckpointManager(Topology.of(root, {name}=...))"

#: Every keyword ``CheckpointManager`` took before the option objects, and where it lives now:
#: each field of an option object but the shorthands the manager still takes.
MOVED: Mapping[str, str] = {
    **{n: _TOPOLOGY for n in ("replicate_to", "node_local", "storage_options", "peer_copies")},
    "fallback": "policy=SavePolicy(sync_fallback=...)",
    **{
        f.name: f"{param}={kind.__name__}({f.name}=...)"
        for param, kind in (
            ("policy", SavePolicy),
            ("retention", Retention),
            ("bounds", Bounds),
            ("resume", Resume),
            ("runtime", Runtime),
        )
        for f in fields(kind)
        if f.name not in ("every", "when_busy", "keep_last", "read_only")
    },
}
