"""``CheckpointManager``: the policy layer a training loop calls once per step.

It owns *when* a save happens and what happens after it, not how bytes are written: saves go
through :func:`dcp_safe.dcp.api.async_save` with a :class:`SafeStorageWriter` and a
:class:`BudgetedStager`; restores through a :class:`SafeStorageReader` with the replica as
fallback.

Call order (one training thread calls ``save``/``maybe_save``/``restore``/``close``)::

    training thread   save(step): admission by ``when_busy`` (at most one save in flight and
                      at most one pending: never an unbounded queue), then stage; with the
                      default ``staging="snapshot"`` it returns once the copy is taken
    upload thread     DCP writes and commits locally
    manager thread    after each upload: verify the new checkpoint, record history, prune by
                      the retention policy, free the slot, start the pending (coalesced) save
    any thread        replication to ``replicate_to`` finishes -> history, ``replicated``

``when_busy`` (a save is still in flight):

* ``"wait"``: block until it is done; the seconds are counted in :meth:`stats`.
* ``"skip"``: return ``None``; counted, logged, and recorded in the history.
* ``"coalesce"``: keep only the newest request. The state is copied *now* (the caller goes on
  mutating it), into one extra host copy, but only if the stager's budget has room for that copy
  besides the pool; otherwise the request is skipped (counted, reason recorded). A newer request
  replaces the pending one, whose handle's futures are cancelled. The pending copy is saved by
  the manager thread as soon as the in-flight save is done.
* ``"sync"``: save now, in the foreground, with a second writer (a writer runs one save at a
  time) and no staging: ``dcp_safe.dcp.api.save`` on the live state.
* ``"raise"``: raise :class:`~dcp_safe.errors.AdmissionTimeoutError` (a wait of zero).

``force=True`` waits whatever the policy: for a final save that must not be lost.

``staging`` (when ``save`` returns, relative to the copy of the state):

* ``"snapshot"`` (default): ``save`` returns once the state is copied into the stager's
  buffers, so the caller may update it in place at once; the training pause is that bounded
  copy. The handle's ``staged`` future is already done.
* ``"overlap"``: ``save`` returns as soon as the copy has started, so the copy overlaps the
  caller's next compute. The caller must then wait (``handle.staged.result()`` or
  :meth:`CheckpointManager.wait_staged`) before the first in-place update of the state: the
  optimizer step, but also in-place updates during the forward pass, such as BatchNorm's
  running statistics. The stager's mutation guard fails a save whose state changed during the
  copy (:class:`~dcp_safe.errors.SnapshotMutatedError`, recorded in the history) rather than
  commit a torn checkpoint, but it cannot see every kind of update (docs/staging.md).

After each local commit the new checkpoint is verified (``validate="manifest"``: marker and
manifest digest; ``"deep"``: every byte), then retention prunes the local root by
:func:`dcp_safe.retention.policy.decide` (``keep_last``/``keep_every`` plus its safety rules);
a checkpoint that fails verification stops pruning, and names being restored or replicated are
kept until a later prune. The remote tier is not pruned. One manager owns a root: retention
treats every committed checkpoint with a step as its own.

History: ``<root>/_history.jsonl`` (:mod:`dcp_safe.checkpoints.history` owns the file and its
schema).

Fallback: :mod:`dcp_safe.manager.fallback` decides when async saving hurts more than it helps
(host memory dipping under the reserve, completions slower than two save intervals, staging
buffers that outlive their save); the manager then saves every request synchronously (as
``"sync"`` does, whether or not a save is in flight), logs a WARNING and records a ``fallback``
event, until :meth:`CheckpointManager.rearm`.

Telemetry (``telemetry=``, off by default): each started save gets a root ``save`` span from
admission to its verified local commit; the stager's and the (wrapped) writer's spans nest under
it; skips and fallbacks are marks. See :mod:`dcp_safe.telemetry`.

Preemption: :meth:`CheckpointManager.install_preemption_handler` (see
:mod:`dcp_safe.manager.preemption`).
The manager keeps a reference to the newest state passed to ``save``/``maybe_save``: the LIVE
state, saved as it is at signal time.

Errors: a background failure (upload, verification, replication) fails the handle's future and
is kept; :meth:`wait` and :meth:`close` raise the first one not yet raised, and
:class:`~dcp_safe.errors.DrainTimeoutError` when work is still in flight at their timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import enum
import functools
import logging
import os
import signal as _signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.catalog import list_checkpoints, verify_checkpoint
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.history import HISTORY_FILE, History
from dcp_safe.choices import parse_choice
from dcp_safe.dcp import api
from dcp_safe.dcp.reader import SafeStorageReader
from dcp_safe.dcp.writer import SafeStorageWriter
from dcp_safe.errors import (
    AdmissionTimeoutError,
    ConfigError,
    DcpSafeError,
    DrainTimeoutError,
    ReplicationSkippedError,
    SnapshotMutatedError,
)
from dcp_safe.manager.fallback import FallbackMonitor, FallbackOptions
from dcp_safe.manager.preemption import PreemptionHandler
from dcp_safe.observe import SpanHandle
from dcp_safe.retention.policy import CheckpointRecord, KeepEvery, KeepLast, combine, decide
from dcp_safe.retention.retire import retire_checkpoint
from dcp_safe.retention.sweeper import DEFAULT_GRACE_S, sweep_partials
from dcp_safe.staging import BudgetedStager, MemoryBudget
from dcp_safe.staging._tree import collect_tensors, rebuild
from dcp_safe.staging.guard import SnapshotGuard, tensor_paths
from dcp_safe.telemetry.recorder import Telemetry

__all__ = [
    "HISTORY_FILE",
    "BusyPolicy",
    "CheckpointManager",
    "ManagerStats",
    "SaveHandle",
    "StagingMode",
    "Validation",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class BusyPolicy(str, enum.Enum):
    """What :meth:`CheckpointManager.save` does while a save is in flight."""

    WAIT = "wait"
    SKIP = "skip"
    COALESCE = "coalesce"
    SYNC = "sync"
    RAISE = "raise"


class StagingMode(str, enum.Enum):
    """When :meth:`CheckpointManager.save` returns relative to the copy of the state."""

    SNAPSHOT = "snapshot"  # after the copy: the caller may mutate the state at once
    OVERLAP = "overlap"  # after the copy started: the caller waits on ``staged`` before mutating


class Validation(str, enum.Enum):
    """How a new local checkpoint is checked before retention may prune older ones."""

    MANIFEST = "manifest"  # marker and manifest digest agree (a few small reads)
    DEEP = "deep"  # every byte against its checksum (verify_checkpoint)


@dataclass(frozen=True)
class SaveHandle:
    """One requested save.

    Attributes:
        step: the training step.
        name: the checkpoint name.
        staged: resolves once the state was copied (the caller may mutate it again); already
            done when ``save`` returns with the default ``staging="snapshot"``.
        committed: resolves with ``name`` once committed locally, verified, and retention ran;
            fails with the upload's or verification's error; cancelled if a newer coalesced
            request replaced this one.
        replicated: resolves once committed on ``replicate_to`` (``None`` without one).
    """

    step: int
    name: str
    staged: Future[None] = field(default_factory=Future, repr=False)
    committed: Future[str] = field(default_factory=Future, repr=False)
    replicated: Future[Any] = field(default_factory=Future, repr=False)

    def cancel(self) -> None:
        for future in (self.staged, self.committed, self.replicated):
            future.cancel()


@dataclass(frozen=True)
class ManagerStats:
    """Counters since the manager was created."""

    requested: int
    started: int
    skipped: int
    coalesced: int
    committed: int
    failed: int
    pruned: int
    waited_s: float
    waiting: int
    sync_saves: int = 0
    fallback_reason: str | None = None


@dataclass
class _Pending:
    handle: SaveHandle
    state: dict[str, Any]
    nbytes: int


class CheckpointManager:
    """Admission-controlled saves, retention and restore under one root.

    Args:
        root: the local (fast) root.
        replicate_to: a second root every local commit is replicated to.
        keep_last: keep this many newest checkpoints (retention; see
            :mod:`dcp_safe.retention.policy` for the safety rules on top).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        when_busy: ``"wait"``, ``"skip"``, ``"coalesce"``, ``"sync"`` or ``"raise"``.
        save_every: :meth:`maybe_save` saves when ``step % save_every == 0``.
        budget: the stager's memory budget (default: measured on this host).
        stager: a stager to use instead of one built here (not closed by :meth:`close`).
        storage_options: fsspec options for both roots.
        validate: ``"manifest"`` or ``"deep"``.
        name_format: ``str.format`` pattern of checkpoint names, with ``{step}``.
        writer: a writer to use instead of one built here (tests, custom options).
        fallback: thresholds of the automatic fallback to synchronous saves
            (``FallbackOptions(enabled=False)`` turns it off).
        memory_sampler: returns the host's available bytes, called at each save request
            (default: psutil's ``virtual_memory().available``; tests inject one).
        clock: monotonic seconds for the fallback's windows and latencies (tests inject one).
        telemetry: records each save's spans (root ``save`` from admission to verified local
            commit; staging, plan, write, commit, release, replication), and marks skips and
            fallbacks; ``None`` (the default) records nothing. Not closed by :meth:`close`.
        attempt: this job attempt's number, for fencing stale writers (default: from
            ``TORCHELASTIC_RESTART_COUNT``; see :mod:`dcp_safe.commit.fencing`).
        staging: ``"snapshot"`` (``save`` returns after the copy) or ``"overlap"`` (it returns
            while the copy runs; wait on ``handle.staged`` before mutating the state).

    Raises:
        ConfigError: a bad option.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        replicate_to: str | os.PathLike[str] | None = None,
        keep_last: int = 2,
        keep_every: int | None = None,
        when_busy: BusyPolicy | str = "wait",
        save_every: int = 1,
        budget: MemoryBudget | None = None,
        stager: BudgetedStager | None = None,
        storage_options: dict[str, Any] | None = None,
        validate: Validation | str = "manifest",
        name_format: str = "step_{step:09d}",
        writer: SafeStorageWriter | None = None,
        fallback: FallbackOptions | None = None,
        memory_sampler: Callable[[], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        partial_grace_s: float = DEFAULT_GRACE_S,
        exit_timeout_s: float = 60.0,
        telemetry: Telemetry | None = None,
        attempt: int | None = None,
        staging: StagingMode | str = "snapshot",
    ) -> None:
        if not isinstance(save_every, int) or save_every < 1:
            raise ConfigError(f"save_every must be an int >= 1, got {save_every!r}")
        self.when_busy: BusyPolicy = parse_choice(BusyPolicy, when_busy, "when_busy")
        self.validate: Validation = parse_choice(Validation, validate, "validate")
        self.staging: StagingMode = parse_choice(StagingMode, staging, "staging")
        self.save_every = save_every
        self.name_format = name_format
        self._name_for(0)  # fail early on a bad pattern
        policies: list[Any] = [KeepLast(keep_last)]
        if keep_every is not None:
            policies.append(KeepEvery(keep_every))
        self.policy = combine(*policies)
        self.storage_options = storage_options
        self.writer = writer or SafeStorageWriter(
            root, replicate_to=replicate_to, storage_options=storage_options, attempt=attempt
        )
        self.root = self.writer.root
        self.replicate_to = self.writer.replicate_to
        self._owns_stager = stager is None
        self.stager = stager or BudgetedStager(budget, when_busy="wait")
        self.telemetry = telemetry
        self._spans: dict[str, SpanHandle] = {}
        if telemetry is not None:
            telemetry.attach_stager(self.stager)
        self._sync_writer: SafeStorageWriter | None = None
        self._cond = threading.Condition()
        self._history = History(self.writer.backend)
        self._prune_lock = threading.Lock()
        self._post = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-manager")
        self._busy: SaveHandle | None = None
        self._last_staged: Future[None] | None = None
        self._pending: _Pending | None = None
        self._replications: dict[str, Future[Any]] = {}
        self._reading: set[str] = set()
        self._errors: list[BaseException] = []
        self._raised = 0
        self._closed = False
        self._counts = dict.fromkeys(
            ("requested", "started", "skipped", "coalesced", "committed", "failed", "pruned"), 0
        )
        self._counts["sync_saves"] = 0
        self._waited_s = 0.0
        self._waiting = 0
        self._validated = self._history.validated_names()
        self._fallback = FallbackMonitor(fallback or FallbackOptions(), self.stager.budget.reserve)
        self._sample_memory = memory_sampler or _host_available_bytes
        self._clock = clock
        self._requested_at: dict[str, float] = {}
        self._latest_state: tuple[int, dict[str, Any]] | None = None
        self._preemption: PreemptionHandler | None = None
        self.partial_grace_s = partial_grace_s
        # Safe at interpreter exit: drain (bounded) what is in flight, without keeping us alive.
        self._at_exit = _close_at_exit(weakref.ref(self), exit_timeout_s)
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, state_dict: dict[str, Any]) -> SaveHandle | None:
        """:meth:`save` when ``step % save_every == 0``, else ``None``."""
        if step % self.save_every:
            return None
        return self.save(step, state_dict)

    def save(
        self, step: int, state_dict: dict[str, Any], *, force: bool = False
    ) -> SaveHandle | None:
        """Save ``state_dict`` as checkpoint ``step``, by the ``when_busy`` policy.

        With ``staging="snapshot"`` (the default) it returns once the state is copied, so the
        caller may update it in place at once; with ``"overlap"`` wait on ``handle.staged`` (or
        :meth:`wait_staged`) first. A copy whose sources changed meanwhile fails the handle's
        futures with :class:`~dcp_safe.errors.SnapshotMutatedError` and publishes nothing.

        Returns:
            The save's handle, or ``None`` when it was skipped.

        Raises:
            AdmissionTimeoutError: busy with ``when_busy="raise"``, or not admitted by the stager.
            BudgetExceededError: the state can never fit the budget.
            ConfigError: the manager is closed, or the name is invalid.
        """
        handle = SaveHandle(step=step, name=self._name_for(step))
        policy = BusyPolicy.WAIT if force else self.when_busy
        with self._cond:
            if self._closed:
                raise ConfigError("this CheckpointManager is closed")
            self._counts["requested"] += 1
            self._latest_state = (step, state_dict)
        with self._preemption_deferred():
            return self._admit(handle, policy, state_dict)

    def _admit(
        self, handle: SaveHandle, policy: BusyPolicy, state_dict: dict[str, Any]
    ) -> SaveHandle | None:
        self._record("requested", handle, tier="local")
        if self._check_fallback(handle):
            self._save_in_foreground(handle, state_dict)
            return handle
        with self._cond:
            if self._busy is not None and policy is BusyPolicy.WAIT:
                self._wait_for_slot()
            start = self._busy is None
            if start:
                self._busy = handle
                self._counts["started"] += 1
        if start:
            self._start(handle, state_dict)
            return handle
        return self._when_busy(policy, handle, state_dict)

    def _wait_for_slot(self) -> None:
        started = time.perf_counter()
        self._waiting += 1
        try:
            while self._busy is not None:
                self._cond.wait()
        finally:
            self._waiting -= 1
            self._waited_s += time.perf_counter() - started

    def _when_busy(
        self, policy: BusyPolicy, handle: SaveHandle, state_dict: dict[str, Any]
    ) -> SaveHandle | None:
        if policy is BusyPolicy.SKIP:
            self._skip(handle, "busy: a save is in flight (when_busy='skip')")
            return None
        if policy is BusyPolicy.RAISE:
            self._skip(handle, "busy: a save is in flight (when_busy='raise')")
            raise AdmissionTimeoutError(
                f"save of step {handle.step} refused: a save is in flight (when_busy='raise')"
            )
        if policy is BusyPolicy.SYNC:
            self._save_in_foreground(handle, state_dict)
            return handle
        return self._coalesce(handle, state_dict)

    def _skip(self, handle: SaveHandle, reason: str) -> None:
        with self._cond:
            self._counts["skipped"] += 1
            self._requested_at.pop(handle.name, None)
        log.info("checkpoint %s skipped: %s", handle.name, reason)
        self._record("skipped", handle, tier="local", reason=reason)
        if self.telemetry is not None:
            self.telemetry.mark("skipped", save=handle.name, step=handle.step, reason=reason)

    def _coalesce(self, handle: SaveHandle, state_dict: dict[str, Any]) -> SaveHandle | None:
        sources = collect_tensors(state_dict)
        need = sum(t.nbytes for t in sources)
        with self._cond:  # the copy it replaces is still alive while this one is taken
            held = self._pending.nbytes if self._pending is not None else 0
        room = self.stager.budget.envelope_bytes - self.stager.stats().pool_bytes - held
        if need > room:
            self._skip(handle, f"coalesce: no memory for a pending copy ({need} > {room} B)")
            return None
        guard = SnapshotGuard(sources)
        state = rebuild(state_dict, {id(t): t.detach().to("cpu", copy=True) for t in sources})
        changed = guard.changed()  # another thread may update the state while it is copied
        if changed:
            self._fail(
                handle, SnapshotMutatedError(tensor_paths(state_dict, changed)), tier="local"
            )
            return handle
        handle.staged.set_result(None)
        start_now = False
        with self._cond:
            replaced, self._pending = self._pending, _Pending(handle, state, need)
            self._counts["coalesced"] += 1
            if self._busy is None:  # the in-flight save finished meanwhile
                start_now = True
                self._busy, self._pending = handle, None
                self._counts["started"] += 1
        if replaced is not None:
            self._supersede(replaced.handle, handle)
        if start_now:
            self._start(handle, state)
        return handle

    def _supersede(self, old: SaveHandle, new: SaveHandle) -> None:
        with self._cond:
            self._counts["skipped"] += 1
            self._requested_at.pop(old.name, None)
        old.cancel()
        self._record("skipped", old, tier="local", reason=f"coalesced into step {new.step}")
        if self.telemetry is not None:
            self.telemetry.mark("skipped", save=old.name, step=old.step, reason="coalesced")

    def _start(self, handle: SaveHandle, state_dict: dict[str, Any]) -> None:
        """Start the async save of ``handle`` (its slot is held); on refusal free the slot."""
        self.writer.step = handle.step
        try:
            with self._save_span(handle):
                response = api.async_save(
                    state_dict,
                    checkpoint_id=handle.name,
                    storage_writer=self._instrumented(self.writer),
                    async_stager=self.stager,
                    no_dist=True,
                )
            self.stager.track(response)
        except BaseException as exc:
            self._fail(handle, exc, tier="local", keep=False)
            self._finish_slot()
            raise
        _chain(response.staging_completion, handle.staged, lambda _: None)
        with self._cond:
            self._last_staged = handle.staged
        response.upload_completion.add_done_callback(
            lambda done: self._post.submit(self._after_upload, handle, done)
        )
        if self.staging is StagingMode.SNAPSHOT:
            # The copy is bounded and budgeted; its failure (a torn snapshot from another
            # thread) reaches the handle's futures and the history, not this call.
            wait_futures([handle.staged], timeout=self.stager.options.timeout_s)

    def wait_staged(self, timeout_s: float | None = None) -> None:
        """Block until the latest started save has copied the state (``"overlap"`` staging).

        After it returns the caller may update the state in place. A failed copy is not raised
        here: it fails the save's handle and is raised by :meth:`wait`/:meth:`close`.

        Raises:
            DrainTimeoutError: the copy was not done after ``timeout_s``.
        """
        with self._cond:
            staged = self._last_staged
        if staged is not None and wait_futures([staged], timeout=timeout_s).not_done:
            raise DrainTimeoutError(f"the state was still being copied after {timeout_s} s")

    def _save_in_foreground(self, handle: SaveHandle, state_dict: dict[str, Any]) -> None:
        writer = self._foreground_writer()
        writer.step = handle.step
        with self._cond:
            self._counts["sync_saves"] += 1
        try:
            with self._save_span(handle):
                api.save(
                    state_dict,
                    checkpoint_id=handle.name,
                    storage_writer=self._instrumented(writer),
                    no_dist=True,
                )
        except BaseException as exc:
            self._fail(handle, exc, tier="local", keep=False)
            raise
        handle.staged.set_result(None)
        self._after_commit(handle, writer)

    def _foreground_writer(self) -> SafeStorageWriter:
        if self._sync_writer is None:
            self._sync_writer = copy.copy(self.writer)  # no replicator: it starts its own
        return self._sync_writer

    # ------------------------------------------------------------------ after a save

    def _after_upload(self, handle: SaveHandle, upload: Future[Any]) -> None:
        """On the manager thread: verify, record, prune, then free the slot."""
        try:
            error = upload.exception()
            if error is not None:
                self._fail(handle, error, tier="local")
            else:
                self._after_commit(handle, self.writer)
        except BaseException as exc:  # a bug here must not wedge the slot
            self._fail(handle, exc, tier="local")
        finally:
            self._finish_slot()

    def _after_commit(self, handle: SaveHandle, writer: SafeStorageWriter) -> None:
        try:
            self._verify(handle.name)
        except (DcpSafeError, OSError) as exc:
            # Neither pruning nor a replication future: the newest checkpoint is not trusted.
            self._fail(handle, exc, tier="local", reason=f"verification failed: {exc}")
            return
        with self._cond:
            self._validated.add(handle.name)
            self._counts["committed"] += 1
            requested_at = self._requested_at.pop(handle.name, None)
            reason = (
                None
                if requested_at is None
                else self._fallback.on_completed(self._clock() - requested_at)
            )
        self._record("committed", handle, tier="local", validated=True)
        if reason is not None:
            self._fell_back(handle, reason)
        self._replicate(handle, writer)
        try:
            self.prune()
        except (DcpSafeError, OSError) as exc:  # the save itself succeeded: keep, do not fail it
            log.warning("retention after %s failed: %s", handle.name, exc)
            with self._cond:
                self._errors.append(exc)
        self._end_span(handle, None)
        handle.committed.set_result(handle.name)

    def _verify(self, name: str) -> None:
        if self.validate is Validation.DEEP:
            verify_checkpoint(self.root, name, storage_options=self.storage_options)
        else:
            open_committed(self.writer.backend, name)

    def _replicate(self, handle: SaveHandle, writer: SafeStorageWriter) -> None:
        if writer.replicate_to is None:
            handle.replicated.set_result(None)
            return
        remote = writer.replication(handle.name)
        with self._cond:  # the handle's future: it is set after the outcome is recorded
            self._replications[handle.name] = handle.replicated
        remote.add_done_callback(lambda done: self._replicated(handle, done))

    def _replicated(self, handle: SaveHandle, done: Future[Any]) -> None:
        if handle.replicated.done():
            return
        error = done.exception()
        if error is None:
            self._record("committed", handle, tier="remote")
            handle.replicated.set_result(done.result())
        elif isinstance(error, ReplicationSkippedError):  # policy, not a failure
            self._record("skipped", handle, tier="remote", reason=str(error))
            handle.replicated.set_exception(error)
        else:
            self._fail(handle, error, tier="remote", future=handle.replicated)
        with self._cond:  # finished: no longer protected from pruning, nothing to wait for
            if self._replications.get(handle.name) is handle.replicated:
                del self._replications[handle.name]
            self._cond.notify_all()

    def _fail(
        self,
        handle: SaveHandle,
        error: BaseException,
        *,
        tier: str,
        reason: str | None = None,
        keep: bool = True,
        future: Future[Any] | None = None,
    ) -> None:
        """Record a failure; ``keep`` holds it for ``wait``/``close`` (raised ones are not)."""
        with self._cond:
            self._counts["failed"] += 1
            self._requested_at.pop(handle.name, None)
            if keep:
                self._errors.append(error)
        log.warning("checkpoint %s failed (%s): %s", handle.name, tier, error)
        if tier == "local":
            self._end_span(handle, error)
        self._record(
            "failed", handle, tier=tier, reason=reason or f"{type(error).__name__}: {error}"
        )
        targets: list[Future[Any]] = (
            [future] if future is not None else [handle.staged, handle.committed]
        )
        for target in targets:
            if not target.done():
                target.set_exception(error)
        if future is None and not handle.replicated.done():
            handle.replicated.set_exception(error)

    # ------------------------------------------------------------------ telemetry

    @contextlib.contextmanager
    def _save_span(self, handle: SaveHandle) -> Any:
        """Open the save's root span; its phases started on this thread nest under it."""
        if self.telemetry is None:
            yield
            return
        span = self.telemetry.begin_save(handle.name, handle.step)
        with self._cond:
            self._spans[handle.name] = span
        with self.telemetry.within(span):
            yield

    def _end_span(self, handle: SaveHandle, error: BaseException | None) -> None:
        with self._cond:
            span = self._spans.pop(handle.name, None)
        if span is None:
            return
        if error is None:
            span.end()
        else:
            span.fail(error)

    def _instrumented(self, writer: SafeStorageWriter) -> Any:
        return writer if self.telemetry is None else self.telemetry.wrap_writer(writer)

    def _finish_slot(self) -> None:
        """Free the slot, or hand it straight to the pending coalesced save."""
        with self._cond:
            pending, self._pending = self._pending, None
            self._busy = pending.handle if pending is not None else None
            if pending is not None:
                self._counts["started"] += 1
            self._cond.notify_all()
        if pending is not None:
            with contextlib.suppress(BaseException):  # _start recorded and kept the error
                self._start_pending(pending)

    def _start_pending(self, pending: _Pending) -> None:
        try:
            self._start(pending.handle, pending.state)
        except BaseException as exc:
            with self._cond:
                self._errors.append(exc)
            raise

    # ------------------------------------------------------------------ retention

    def prune(self) -> tuple[str, ...]:
        """Apply retention to both tiers now; returns the local names removed.

        Checkpoints being read by :meth:`restore` or still being replicated are kept (until a
        later prune). Names this manager did not save (no step in the manifest) are left alone.
        On the remote tier a committed checkpoint counts as validated: the replicator checked
        every item's checksum and every object's size before it wrote the remote marker.
        Abandoned partials older than ``partial_grace_s`` are collected on both tiers.
        """
        dropped = self._prune_local()
        if self.writer.remote is not None and self.replicate_to is not None:
            self._prune_remote(self.writer.remote, self.replicate_to)
        sweep_partials(
            self.root, grace_s=self.partial_grace_s, storage_options=self.storage_options
        )
        return dropped

    def _prune_remote(self, remote: Backend, url: str) -> None:
        options = self.writer.replicate_storage_options
        with self._preemption_deferred(), self._prune_lock:
            infos = list_checkpoints(url, storage_options=options)
            records = [CheckpointRecord(i.name, i.step, True) for i in infos if i.step is not None]
            with self._cond:
                protected = {n for n, f in self._replications.items() if not f.done()}
            for name in decide(records, self.policy, protected=protected).drop:
                retire_checkpoint(remote, name)
                step = next(r.step for r in records if r.name == name)
                self._record("pruned", (step, name), tier="remote", reason="retention")

    def _prune_local(self) -> tuple[str, ...]:
        with self._preemption_deferred(), self._prune_lock:
            infos = [i for i in list_checkpoints(self.root, storage_options=self.storage_options)]
            with self._cond:
                records = [
                    CheckpointRecord(i.name, i.step, i.name in self._validated)
                    for i in infos
                    if i.step is not None
                ]
                protected = set(self._reading) | {
                    n for n, f in self._replications.items() if not f.done()
                }
            decision = decide(records, self.policy, protected=protected)
            for name in decision.drop:
                retire_checkpoint(self.writer.backend, name)
                with self._cond:
                    self._validated.discard(name)
                    self._replications.pop(name, None)
                    self._counts["pruned"] += 1
                step = next(r.step for r in records if r.name == name)
                self._record("pruned", (step, name), tier="local", reason="retention")
            return decision.drop

    # ------------------------------------------------------------------ reading

    def latest(self, tier: str = "local") -> str | None:
        """The newest committed checkpoint's name on ``tier`` (``"local"`` or ``"remote"``)."""
        if tier not in ("local", "remote"):
            raise ConfigError(f"tier must be 'local' or 'remote', got {tier!r}")
        local = tier == "local"
        root = self.root if local else self.replicate_to
        if root is None:
            raise ConfigError("this manager has no replicate_to")
        options = self.storage_options if local else self.writer.replicate_storage_options
        found = list_checkpoints(root, storage_options=options)
        return found[-1].name if found else None

    def restore(self, state_dict: dict[str, Any], step: int | str = layout.LATEST) -> str:
        """Load checkpoint ``step`` (or the newest) into ``state_dict``, in place.

        The local root is read first, ``replicate_to`` is the fallback. The checkpoint is kept
        from pruning while it is read.

        Returns:
            The name loaded.

        Raises:
            CheckpointNotFoundError: nothing committed by that name on either tier.
            CheckpointCorruptError: the bytes do not match their manifest on any tier.
        """
        wanted = step if step == layout.LATEST else self._name_for(int(step))
        reading = self.latest("local") if wanted == layout.LATEST else wanted
        reader = SafeStorageReader(
            self.root,
            storage_options=self.storage_options,
            fallback=self.replicate_to,
            fallback_storage_options=self.writer.replicate_storage_options,
        )
        with self._preemption_deferred(), self._reading_guard(reading):
            api.load(state_dict, checkpoint_id=wanted, storage_reader=reader, no_dist=True)
        return reader.checkpoint_id or str(wanted)

    @contextlib.contextmanager
    def _reading_guard(self, name: str | None) -> Any:
        with self._cond:
            if name is not None:
                self._reading.add(name)
        try:
            yield
        finally:
            with self._cond:
                self._reading.discard(name or "")

    # ------------------------------------------------------------------ draining

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until no save is in flight or pending and replications are done.

        Raises:
            DrainTimeoutError: still busy after ``timeout_s``.
            BaseException: the first background error not raised before.
        """
        with self._preemption_deferred():
            self._drain(timeout_s)

    def _drain(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            idle = self._cond.wait_for(
                lambda: self._busy is None and self._pending is None, timeout_s
            )
            remotes = list(self._replications.values())
        if not idle:
            raise DrainTimeoutError(f"a save was still in flight after {timeout_s} s")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if wait_futures(remotes, timeout=left).not_done:
            raise DrainTimeoutError(f"replication still running after {timeout_s} s")
        self._post.submit(lambda: None).result()  # callbacks queued behind the last save
        self._raise_first()

    def close(self, timeout_s: float | None = None) -> None:
        """Drain, prune once more, stop, then raise the first background error. Idempotent.

        Raises:
            DrainTimeoutError: work still in flight after ``timeout_s`` (it is left running).
            BaseException: the first background error not raised before.
        """
        if self._preemption is not None:
            self._preemption.uninstall()
        with self._cond:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._at_exit)
        errors: list[BaseException] = []
        steps: list[Callable[[], object]] = [lambda: self.wait(timeout_s), self.prune]
        steps.append(lambda: self._post.shutdown(wait=True))
        if self._owns_stager:
            steps.append(self.stager.close)
        for writer in (self.writer, self._sync_writer):
            if writer is not None:
                steps.append(functools.partial(writer.close, timeout_s))
        for step in steps:
            _collect(step, errors)
        with self._cond:
            errors = self._errors[self._raised :] + errors
            self._raised = len(self._errors)
        if errors:
            raise errors[0]

    def _raise_first(self) -> None:
        with self._cond:
            if self._raised >= len(self._errors):
                return
            error = self._errors[self._raised]
            self._raised = len(self._errors)
        raise error

    def stats(self) -> ManagerStats:
        """The counters now."""
        with self._cond:
            return ManagerStats(
                **self._counts,
                waited_s=self._waited_s,
                waiting=self._waiting,
                fallback_reason=self._fallback.reason,
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(BaseException):  # do not mask the body's exception
            self.close()

    def _name_for(self, step: int) -> str:
        try:
            name = self.name_format.format(step=step)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"bad name_format {self.name_format!r}: {exc}") from None
        return layout.validate_name(name)

    def _record(
        self, event: str, handle: SaveHandle | tuple[int | None, str | None], **extra: Any
    ) -> None:
        step, name = (handle.step, handle.name) if isinstance(handle, SaveHandle) else handle
        self._history.append(event, step, name, **extra)

    def history(self) -> list[dict[str, Any]]:
        """The history file's events, oldest first."""
        return self._history.read()

    # ------------------------------------------------------------------ fallback

    def _check_fallback(self, handle: SaveHandle) -> bool:
        """Feed the monitor at a save request; True when this save must be synchronous."""
        now = self._clock()
        available = self._sample_memory()
        with self._cond:
            self._requested_at[handle.name] = now
            reason = self._fallback.on_request(now, available)
            idle = self._busy is None and self._pending is None
        # Idle first, stats second: only this thread starts saves, so once idle, what the stager
        # still has in use was leaked by a finished save, not leased by a new one.
        in_use = self.stager.stats().in_use_bytes if idle and reason is None else 0
        with self._cond:
            reason = reason or self._fallback.on_idle(in_use)
            tripped = self._fallback.tripped
        if reason is not None:
            self._fell_back(handle, reason)
        return tripped

    def _fell_back(self, handle: SaveHandle, reason: str) -> None:
        log.warning("dcp_safe: falling back to synchronous checkpoints: %s", reason)
        self._record("fallback", handle, reason=reason)
        if self.telemetry is not None:
            self.telemetry.mark("fallback", save=handle.name, step=handle.step, reason=reason)

    def rearm(self) -> None:
        """Switch back to asynchronous saves after a fallback (no-op when not fallen back)."""
        with self._cond:
            was = self._fallback.reason
            self._fallback.rearm()
        if was is not None:
            log.info("dcp_safe: asynchronous checkpoints re-armed (fell back: %s)", was)
            self._record("rearmed", (None, None), reason=f"was: {was}")

    # ------------------------------------------------------------------ preemption

    def install_preemption_handler(
        self, signal: int = _signal.SIGTERM, budget_s: float = 30.0
    ) -> PreemptionHandler:
        """On ``signal``, drain within ``budget_s`` and save the latest state synchronously.

        See :mod:`dcp_safe.manager.preemption` for the sequence and its limits. Call on the main
        thread; :meth:`close` uninstalls it.

        Returns:
            The installed handler (``uninstall()`` restores the previous one).

        Raises:
            ConfigError: not on the main thread, a bad budget, or one is installed already.
        """
        if self._preemption is not None:
            raise ConfigError("a preemption handler is installed already")
        self._preemption = PreemptionHandler(self, signal, budget_s)
        self._preemption.install()
        return self._preemption

    @contextlib.contextmanager
    def _preemption_deferred(self) -> Any:
        handler = self._preemption
        if handler is None:
            yield
            return
        with handler.deferred():
            yield

    def preempt_save(self, reason: str, deadline: float) -> str:
        """Drain the save in flight for half the time to ``deadline`` (``time.monotonic``), then
        save the latest state synchronously if it is not committed and time remains. For the
        preemption handler.

        Returns:
            What happened, one line (also in the ``preempted`` history event).
        """
        with self._cond:
            pending, self._pending = self._pending, None
            drain_s = max(0.0, deadline - time.monotonic()) / 2  # half kept for the final save
            self._cond.wait_for(lambda: self._busy is None, drain_s)
            busy, latest = self._busy, self._latest_state
        if pending is not None:
            pending.handle.cancel()
            self._record("skipped", pending.handle, tier="local", reason="preempted")
        if latest is None:
            outcome = "nothing was ever saved"
        else:
            outcome = self._final_save(latest, busy, deadline)
        step, name = (None, None) if latest is None else (latest[0], self._name_for(latest[0]))
        self._record("preempted", (step, name), reason=f"{reason}: {outcome}")
        log.warning("dcp_safe: preempted (%s): %s", reason, outcome)
        return outcome

    def _final_save(
        self, latest: tuple[int, dict[str, Any]], busy: SaveHandle | None, deadline: float
    ) -> str:
        step, state = latest
        handle = SaveHandle(step=step, name=self._name_for(step))
        drained = "abandoned the save in flight" if busy is not None else "drained"
        with self._cond:
            committed = handle.name in self._validated
        if committed:
            return f"{drained}; step {step} was committed already"
        if busy is not None and busy.name == handle.name:
            return f"{drained}; step {step} is that save, so no final save"
        if time.monotonic() >= deadline:
            return f"{drained}; no time left for a final save of step {step}"
        self._record("requested", handle, tier="local")
        try:
            self._save_in_foreground(handle, state)
        except BaseException as exc:  # recorded as failed by _save_in_foreground
            return f"{drained}; final save of step {step} failed: {exc}"
        if not handle.committed.done() or handle.committed.exception() is not None:
            return f"{drained}; final save of step {step} did not verify"
        return f"{drained}; final synchronous save of step {step} committed"

    def in_flight(self) -> bool:
        """A save is in flight or pending."""
        with self._cond:
            return self._busy is not None or self._pending is not None


def _host_available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _chain(source: Future[Any], target: Future[T], convert: Callable[[Any], T]) -> None:
    def forward(done: Future[Any]) -> None:
        with contextlib.suppress(InvalidStateError):  # a failure recorded it first
            try:
                target.set_result(convert(done.result()))
            except CancelledError:
                target.cancel()
            except BaseException as exc:
                target.set_exception(exc)

    source.add_done_callback(forward)


def _collect(step: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        step()
    except BaseException as exc:
        errors.append(exc)


def _close_at_exit(manager: weakref.ref[CheckpointManager], timeout_s: float) -> Callable[[], None]:
    def close() -> None:
        live = manager()
        if live is not None:
            try:
                live.close(timeout_s)
            except BaseException:
                log.exception("dcp_safe: draining the CheckpointManager at exit failed")

    return close
