"""``CheckpointManager``: the policy layer a training loop calls once per step.

It owns *when* a save happens and what follows it, not how bytes are written; it composes the
parts of :mod:`dcp_safe.manager`. Call order: one training thread calls
``save``/``maybe_save``/``restore``/``close``; DCP uploads on its own thread; the follow-up of
each commit (verify, history, retention, the pending save) runs on the manager thread. Under
``torchrun`` every rank builds its manager with the same arguments at the same point and calls
it with the same steps: see docs/multirank.md, "The manager under torchrun".

Errors: a background failure fails the handle's future and is kept; :meth:`wait` and
:meth:`close` raise the first one not raised yet (``DrainTimeoutError``: work still in flight).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import signal as _signal
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import wait as wait_futures
from typing import Any

from dcp_safe import layout
from dcp_safe.adapters import api
from dcp_safe.adapters.node_local import writer_for
from dcp_safe.adapters.planners import RestoreReport, SafeLoadPlanner
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.checkpoints.history import History
from dcp_safe.choices import refuse_moved
from dcp_safe.coordination.agreement import Agreement
from dcp_safe.coordination.groups import FOREGROUND
from dcp_safe.coordination.worker_group import WorkerGroups
from dcp_safe.errors import (
    AdmissionTimeoutError,
    CheckpointNotFoundError,
    ConfigError,
    DrainTimeoutError,
)
from dcp_safe.manager.cadence import Cadence
from dcp_safe.manager.fallback import FallbackMonitor, FallbackSwitch, MemoryWatch
from dcp_safe.manager.handles import BusyPolicy, ManagerStats, SaveHandle, StagingMode, Validation
from dcp_safe.manager.in_memory import InMemoryTier
from dcp_safe.manager.ledger import READ_FLUSH_S, Ledger
from dcp_safe.manager.options import (
    MOVED,
    Bounds,
    Resume,
    Retention,
    Runtime,
    SavePolicy,
    choose_executor,
    given,
)
from dcp_safe.manager.preemption import (
    PreemptionHandler,
    agreed_plan,
    close_at_exit,
    countdown,
    run_bounded,
)
from dcp_safe.manager.saving import SaveRunner, Verdict
from dcp_safe.manager.slot import SaveSlot
from dcp_safe.manager.tiers import Tiers, WarmStart
from dcp_safe.manifest.schema import Metrics
from dcp_safe.reading.safetensors_import import SafetensorsReader, SafetensorsSource
from dcp_safe.staging import BudgetedStager, MemoryBudget
from dcp_safe.topology import Topology
from dcp_safe.worker.parent import SaveWorker

log = logging.getLogger(__name__)


class CheckpointManager:
    """Admission-controlled saves, retention and restore under one root.

    Args:
        root: the commit root, or a :class:`~dcp_safe.Topology` (a replica, a node cache and
            its peer copies, each root's fsspec options: ``Topology.of(root, ...)``).
        save_every: shorthand for ``policy=SavePolicy(every=)``: :meth:`maybe_save` saves when
            ``step % save_every == 0``.
        keep_last: shorthand for ``retention=Retention(keep_last=)``.
        when_busy: shorthand for ``policy=SavePolicy(when_busy=)``; see :class:`BusyPolicy`.
        policy: when a save happens and how it is taken (:class:`SavePolicy`).
        retention: which checkpoints stay (:class:`Retention`).
        bounds: host memory and deadlines (:class:`Bounds`).
        resume: per-rank state, warm start, the in-memory copy, the attempt (:class:`Resume`).
        runtime: the executor and the parts saves run on (:class:`Runtime`).

    A shorthand given with its object replaces that one field of it. Every other keyword of
    the old layout raises a ``ConfigError`` naming where it moved
    (:data:`dcp_safe.manager.options.MOVED`).

    Raises:
        ConfigError: a bad option, or one passed the old way.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Topology,
        *,
        save_every: int | None = None,
        keep_last: int | None = None,
        when_busy: BusyPolicy | str | None = None,
        policy: SavePolicy | None = None,
        retention: Retention | None = None,
        bounds: Bounds | None = None,
        resume: Resume | None = None,
        runtime: Runtime | None = None,
        **moved: Any,
    ) -> None:
        # read_only=True is runtime=Runtime(read_only=True), the spelling an evaluation job
        # reaches for first; taken from the moved keywords: the signature holds ten at most.
        if "read_only" in moved:
            runtime = dataclasses.replace(runtime or Runtime(), read_only=moved.pop("read_only"))
        refuse_moved("CheckpointManager", moved, MOVED)
        policy = given(policy or SavePolicy(), every=save_every, when_busy=when_busy)
        retention = given(retention or Retention(), keep_last=keep_last)
        runtime = runtime or Runtime()
        bounds, resume = bounds or Bounds(), resume or Resume()
        self.policy, self.retention, self.save_every = policy, retention, policy.every
        self.read_only = runtime.read_only  # a reader beside training: no writes
        self.when_busy, self.staging = BusyPolicy(policy.when_busy), StagingMode(policy.staging)
        self.deadline_s, wait_s = bounds.deadline_s, bounds.wait_timeout_s
        writer, stager, telemetry = runtime.writer, runtime.stager, runtime.telemetry
        if writer is None:
            topology = root if isinstance(root, Topology) else Topology.of(root)
            writer = writer_for(topology, attempt=resume.attempt, remote_timeout_s=wait_s)
        elif isinstance(root, Topology) and root != writer.topology:
            raise ConfigError("runtime=Runtime(writer=) brings its own topology: pass its root")
        self.writer, self.topology, self.replicate_to = writer, writer.topology, writer.replicate_to
        self.root = self.topology.commit.url  # where committed checkpoints live
        self._owns_stager = stager is None
        budget = bounds.budget
        if stager is None and budget is None:
            # The uploads' part buffers stay held while the next save stages: part of the
            # envelope the staged copies must leave free (a budget passed in is the caller's).
            budget = MemoryBudget.from_host(other_consumers_bytes=writer.upload_buffer_bytes or 0)
        self.executor = choose_executor(
            runtime.executor, stager, writer, writer_given=runtime.writer is not None
        )
        self.stager = stager or BudgetedStager(budget, shared_memory=self.executor == "process")
        self.telemetry = telemetry
        if telemetry is not None:
            telemetry.attach_stager(self.stager)
        self._watch, sample = None, runtime.memory_sampler
        if sample is None:  # the lowest reading of a 1 s sampler since the last request
            self._watch = MemoryWatch()
            sample = self._watch.lowest
        self._preemption: PreemptionHandler | None = None
        self._closed = False
        self._latest_state: tuple[int, dict[str, Any]] | None = None
        self._agreement = agreement = Agreement.for_job(self.deadline_s)
        # Every byte of a new checkpoint is checked by the coordinator; the others check its
        # marker and manifest.
        deep = policy.validate is Validation.DEEP and agreement.coordinator
        owns = agreement.coordinator and not self.read_only  # the history, pruning, sweeping
        self._ledger = ledger = Ledger(History(writer.commit_backend), telemetry, coordinator=owns)
        self._cond, self._slot = ledger.cond, SaveSlot(ledger.cond)
        self._tiers = Tiers(
            writer,
            retention=retention,
            ledger=ledger,
            deferred=self._preemption_deferred,
            coordinator=owns,
            # A restore's transient reads fit the envelope the staged copies of a save do.
            load_budget_bytes=max(1, self.stager.budget.envelope_bytes),
            deadline_s=self.deadline_s,
            read_only=self.read_only,
        )
        monitor = FallbackMonitor(policy.sync_fallback, self.stager.budget.node_reserve)
        self._switch = FallbackSwitch(monitor, sample, runtime.clock, ledger)
        self._in_memory: InMemoryTier | None = None
        if resume.keep_in_memory:
            self._in_memory = InMemoryTier(self.stager, writer.commit_backend, resume.per_rank)
        worker = None
        if self.executor == "process" and self.stager.shared is not None:
            groups = WorkerGroups.for_job(agreement)  # several ranks: theirs to form
            adopt = None if telemetry is None else ledger.adopt  # the worker's spans
            worker = SaveWorker(
                writer, self.stager.shared, resume.per_rank, wait_s, groups, adopt, deep
            )
        self._runner = SaveRunner(
            writer=writer,
            stager=self.stager,
            slot=self._slot,
            ledger=ledger,
            tiers=self._tiers,
            switch=self._switch,
            deep=deep,
            per_rank=resume.per_rank,
            in_memory=self._in_memory,
            worker=worker,
            agreement=agreement,
            policy=policy,
            bounds=bounds,
        )
        self._cadence = Cadence(policy, runtime.clock, agreement, self._slot, ledger, history=owns)
        self._warm_start = None
        if (warm := resume.initial_load_from) is not None:  # read with this run's root's options
            self._warm_start = WarmStart.of(warm, self.topology.commit, resume.initial_load_keys)
        # A listing on shared storage: never bounded tighter than a collective.
        self._resolve_s = max(wait_s, self.deadline_s)
        # The reader of the latest restore; with node_local, its stats() say which files came
        # from this node's cache and which from root, and why.
        self.last_reader: SafeStorageReader | None = None
        # Safe at interpreter exit: drain (bounded) what is in flight, without keeping us alive.
        self._at_exit = close_at_exit(weakref.ref(self), bounds.exit_timeout_s)
        atexit.register(self._at_exit)

    def maybe_save(
        self, step: int, state_dict: dict[str, Any], *, metrics: Metrics | None = None
    ) -> SaveHandle | None:
        """:meth:`save` when ``step`` is due by the policy's cadence, else ``None``."""
        self._writable("maybe_save")
        with self._preemption_deferred():  # as the save's vote: a signal waits for its end
            due = self._cadence.due(step)
        return self.save(step, state_dict, metrics=metrics) if due else None

    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        force: bool = False,
        metrics: Metrics | None = None,
    ) -> SaveHandle | None:
        """Save ``state_dict`` as checkpoint ``step``, by the ``when_busy`` policy.

        With ``staging="snapshot"`` (the default) it returns once the state is copied; with
        ``"overlap"`` wait on ``handle.staged`` (or :meth:`wait_staged`) before mutating it. A
        copy whose sources changed meanwhile fails the handle with
        :class:`~dcp_safe.errors.SnapshotMutatedError` and publishes nothing. ``force=True``
        waits whatever ``when_busy`` says (bounded by ``wait_timeout_s``). ``metrics`` go to the
        manifest, ``dcp-safe ls`` and the history (docs/manager.md, "Retention").

        Returns:
            The save's handle, or ``None`` when it was skipped.

        Raises:
            AdmissionTimeoutError: busy with ``when_busy="raise"``, or not admitted by the stager.
            BudgetExceededError: the state can never fit the budget.
            ConfigError: the manager is closed, or the name or ``metrics`` are invalid.
        """
        self._writable("save")
        handle = SaveHandle(step=step, name=self._name_for(step), metrics=metrics)
        self._cadence.watch(handle)  # its commit restarts interval_s; auto times it
        policy = BusyPolicy.WAIT if force else self.when_busy
        with self._cond:
            if self._closed:
                raise ConfigError("this CheckpointManager is closed")
            self._latest_state = (step, state_dict)
        self._ledger.count("requested")
        with self._preemption_deferred():
            self._ledger.record("requested", handle, tier="local")
            self._ledger.track(handle)
            try:
                # Frozen while the ranks vote: a save ending meanwhile must not start the pending
                # one on this rank alone.
                with self._slot.frozen():
                    decision = self._runner.admit(handle, policy, state_dict, force=force)
                    if decision.verdict is Verdict.COALESCE:
                        return self._runner.coalesce(handle, state_dict, decision.worker)
                if decision.verdict is Verdict.WAIT:
                    decision = self._runner.wait(handle, force=force, worker=decision.worker)
                verdict, reason = decision.verdict, decision.reason
                if verdict is Verdict.START:
                    self._slot.take(handle)  # free: this rank voted idle, or waited until it was
                    self._ledger.count("started")
                    self._runner.start(handle, state_dict, decision.worker)
                    return handle
                if verdict is Verdict.SYNC:
                    self._runner.foreground(handle, state_dict)
                    return handle
            except BaseException as exc:  # a request that raised ends in an outcome on every rank
                if not handle.committed.done():
                    self._ledger.fail(handle, exc, tier="local", keep=False)
                raise
            self._ledger.skip(handle, reason)
            if verdict is Verdict.RAISE:
                raise AdmissionTimeoutError(f"save of step {handle.step} refused: {reason}")
            return None

    def wait_staged(self, timeout_s: float | None = None) -> None:
        """Block until the latest started save has copied the state (``"overlap"`` staging).

        A failed copy is not raised here: it fails the handle, and :meth:`wait`/:meth:`close`.
        ``DrainTimeoutError``: the copy was not done after ``timeout_s``.
        """
        self._runner.wait_staged(timeout_s)

    def prune(self) -> tuple[str, ...]:
        """Apply retention to both tiers now (:meth:`Tiers.prune`); the local names removed."""
        self._writable("prune")
        return self._tiers.prune()

    def latest(self, tier: str = "local") -> str | None:
        """The newest committed checkpoint's name on ``tier`` (``"local"`` or ``"remote"``)."""
        return self._tiers.latest(tier)

    def restore(
        self,
        state_dict: dict[str, Any],
        step: int | str = layout.LATEST,
        *,
        keys: Collection[str] | None = None,
        exclude: Sequence[str] = (),
        allow_partial: bool = False,
        audit: bool = False,
        source: str | os.PathLike[str] | SafetensorsSource | None = None,
    ) -> RestoreReport:
        """Load checkpoint ``step`` (or the newest) into ``state_dict``, in place.

        From the local root, then ``replicate_to`` (or the node cache, then ``root``); with
        nothing committed there, ``initial_load_from``. With ``source``, from there instead.

        Args:
            keys: restore only these keys (or key prefixes, as DCP flattens the state dict).
            exclude: leave these keys (or prefixes) as they are.
            allow_partial: keys the checkpoint lacks are left as they are, not an error.
            audit: check after the load that the live tensors equal what was saved (block
                fingerprints recorded at save; RestoreMismatchError names key, block, rank).
            source: load this instead, as ``initial_load_from`` names one: another run's root
                or ``ROOT/NAME``, or Hugging Face weights (a
                :class:`~dcp_safe.manager.SafetensorsSource`, a model folder,
                ``model.safetensors[.index.json]``; docs/resume.md). Its URL and, for
                safetensors, its digest go to the history's ``restored`` event.

        Returns:
            The name loaded (a ``str``) with what was restored, skipped, missing, not asked for.

        Raises:
            CheckpointNotFoundError: nothing committed by that name (nor to warm-start from).
            CheckpointCorruptError: the bytes do not match their manifest on any tier.
            MissingKeysError: keys asked for are not in the checkpoint (without allow_partial).
            PerRankStateError: per-rank entries were saved by another world size.
            RestoreMismatchError: ``audit`` found the live state differs from the saved one.
            LoadError: a rank's load failed (a shape that does not match, say), cause named.
        """
        latest = step == layout.LATEST
        own = self._tiers.reader()
        given = None if source is None else WarmStart.of(source, self.topology.commit)
        if given is not None and not latest:
            raise ConfigError("restore(source=) takes no step: name a checkpoint as ROOT/NAME")
        warm = given or self._warm_start

        def resolve() -> tuple[str | None, str]:
            if given is not None:
                return given.resolve(self._tiers.signing_key)
            try:
                own.reset(layout.LATEST if latest else self._name_for(int(step)))
                return None, str(own.checkpoint_id)
            except CheckpointNotFoundError:
                # Another run's checkpoint only while the own tiers hold none at all.
                if self._warm_start is None or not latest or self.latest():
                    raise
                return self._warm_start.resolve(self._tiers.signing_key)

        with self._preemption_deferred():
            number = -1 if latest else int(step)
            url, name = self._agreement.settle("restore", number, resolve, self._resolve_s)
            reader: SafeStorageReader | SafetensorsReader = own
            where, tier = "this run", "local"
            if url is not None:
                assert warm is not None
                # The URL as given (credentials travel in options, never in it), shortened.
                reader = warm.reader(url, self._tiers)
                url = url[:300]
                where = f"{'warm start' if given is None else 'source'} from {url}"
                tier = "initial"
                keys = warm.keys if keys is None else keys
            self.last_reader = reader if isinstance(reader, SafeStorageReader) else None
            planner = SafeLoadPlanner(
                per_rank=self._runner.per_rank,
                keys=keys,
                exclude=exclude,
                allow_partial=allow_partial,
                name=name,
            )
            with (
                self._tiers.reading(name if url is None else None),
                self._runner.collectives(FOREGROUND) as collectives,
            ):
                api.load(
                    state_dict,
                    checkpoint_id=name,
                    storage_reader=reader,
                    planner=planner,
                    audit=audit,
                    **collectives,
                )
        report = planner.report
        digest = reader.digest if isinstance(reader, SafetensorsReader) else None
        reason = "; ".join(
            [where, f"{len(report.restored)} keys restored"]
            + [f"{len(report.skipped)} skipped on request"] * bool(report.skipped)
            + [f"{len(report.missing)} missing, left as they were"] * bool(report.missing)
        )
        self._ledger.record(
            "restored", (None, name), tier=tier, reason=reason, source=url, source_digest=digest
        )
        return report

    def rollback(self, state_dict: dict[str, Any]) -> int:
        """Restore the last committed step into ``state_dict`` from host memory, in place.

        Needs ``resume=Resume(keep_in_memory=True)``. Reads no storage: the kept copy is checked
        against the committed manifest's checksums first (docs/resume.md, "Rolling back in
        memory"). Every rank checks before any copies, so either every rank rolls back or none
        does. Returns the step restored.

        Raises:
            ConfigError: the manager was built without ``Resume(keep_in_memory=True)``.
            RollbackUnavailableError: no kept copy of the last committed step (or the ranks'
                differ: call :meth:`wait` on every rank first); nothing changed.
            CheckpointCorruptError: the kept copy changed since it was committed; nothing changed.
            MissingKeysError: ``state_dict`` has keys the kept copy lacks; nothing changed.
        """
        if self._in_memory is None:
            raise ConfigError("rollback() needs resume=Resume(keep_in_memory=True)")
        step = self._in_memory.rollback(state_dict, self._agreement)
        self._ledger.record("rolled_back", (step, self._name_for(step)), tier="memory")
        return step

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until no save is in flight or pending and replications are done.

        Raises:
            DrainTimeoutError: still busy after ``timeout_s``.
            BaseException: the first background error not raised before.
        """
        left = countdown(timeout_s)
        with self._preemption_deferred():
            idle = self._slot.idle(timeout_s)
            remotes = self._tiers.replications()
            if not idle:
                raise DrainTimeoutError(f"a save was still in flight after {timeout_s} s")
            if wait_futures(remotes, timeout=left()).not_done:
                raise DrainTimeoutError(f"replication still running after {timeout_s} s")
            # Callbacks queued behind the last save (a coalesced save meeting its peers).
            if wait_futures([self._runner.post.submit(lambda: None)], timeout=left()).not_done:
                raise DrainTimeoutError(f"the manager thread was still busy after {timeout_s} s")
            self._ledger.flush(left())
            if errors := self._ledger.unraised():  # the oldest; the others count as raised
                raise errors[0]

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
        left = countdown(timeout_s)
        worker = self._runner.worker
        writers = [w for w in (self.writer, self._runner.sync_writer) if w is not None]
        steps: list[Callable[[], object] | None] = [
            lambda: self.wait(left()),
            self._tiers.prune,
            lambda: self._runner.post.shutdown(wait=True),
            None if worker is None else lambda: worker.close(left()),  # before the stager's slabs
            self.stager.close if self._owns_stager else None,
            None if self._watch is None else self._watch.close,
            *(functools.partial(lambda w: w.close(left()), w) for w in writers),
            lambda: self._ledger.close_history(left()),
        ]
        errors = run_bounded([step for step in steps if step is not None], timeout_s)
        if worker is not None:  # whatever the steps did (a save stuck in a stopped worker)
            worker.kill()
        self._agreement.release()
        # Work still in flight first: a kept error of a past save must not hide it.
        errors = sorted(
            self._ledger.unraised() + errors, key=lambda e: not isinstance(e, DrainTimeoutError)
        )
        if errors and isinstance(errors[0], DrainTimeoutError):
            self._ledger.abandon(errors[0])  # no caller waits for ever on what is left
        if errors:
            raise errors[0]

    def stats(self) -> ManagerStats:
        """The counters now."""
        with self._cond:
            return ManagerStats(
                **self._ledger.counts(),
                pruned=self._tiers.pruned,
                waited_s=self._slot.waited_s,
                waiting=self._slot.waiting,
                fallback_reason=self._switch.reason,
                **vars(self._cadence.goodput.choice()),
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # Raised out of a clean body; never masking the body's exception.
        with contextlib.suppress(*(() if exc_type is None else (BaseException,))):
            self.close()

    def _writable(self, call: str) -> None:
        if self.read_only or self._closed:
            why = "read-only (Runtime(read_only=True))" if self.read_only else "closed"
            raise ConfigError(f"{call}() writes, and this CheckpointManager is {why}")

    def _name_for(self, step: int) -> str:
        return layout.format_name(self.policy.name_format, step)

    def history(self) -> list[dict[str, Any]]:
        """The history file's events, oldest first (written by the coordinator only)."""
        self._ledger.flush(READ_FLUSH_S)  # the appends queued so far first
        return self._ledger.history.read()

    def decisions(self) -> list[dict[str, Any]]:
        """This rank's own record of events (history events without their times), oldest
        first: the same on every rank, though only the coordinator writes the history file."""
        return self._ledger.events()

    def rearm(self) -> None:  # the fallback
        """Switch back to asynchronous saves after a fallback (no-op when not fallen back)."""
        self._switch.rearm()

    def install_preemption_handler(
        self, signal: int = _signal.SIGTERM, budget_s: float = 30.0
    ) -> PreemptionHandler:
        """On ``signal``, drain within ``budget_s`` and save the latest state synchronously.

        The sequence and its limits: docs/runbook.md, "Preemption". Call on the main thread;
        :meth:`close` uninstalls it.

        Returns:
            The installed handler (``uninstall()`` restores the previous one).

        Raises:
            ConfigError: not on the main thread, a bad budget, or one is installed already.
        """
        self._writable("install_preemption_handler")
        if self._preemption is not None:
            raise ConfigError("a preemption handler is installed already")
        self._preemption = PreemptionHandler(self, signal, budget_s)
        self._preemption.install()
        return self._preemption

    def _preemption_deferred(self) -> contextlib.AbstractContextManager[None]:
        handler = self._preemption
        return contextlib.nullcontext() if handler is None else handler.deferred()

    def preempt_save(self, reason: str, deadline: float) -> str:
        """For the preemption handler: drop the pending save, drain the one in flight for half
        the time left (``deadline``: ``time.monotonic()`` by which the job must be gone), then
        save the latest state synchronously if it is not committed and time remains, on every
        rank or none (the final save is a collective).

        Returns:
            What happened, one line (also in the ``preempted`` history event).
        """
        with self._cond:
            latest = self._latest_state
        pending = self._runner.drop_pending()  # its peers learn it too
        busy = self._slot.drain(max(0.0, deadline - time.monotonic()) / 2)  # half: final save
        if pending is not None:
            pending.handle.cancel()
            self._ledger.record("skipped", pending.handle, tier="local", reason="preempted")
        drained = "abandoned the save in flight" if busy is not None else "drained"
        handle = None if latest is None else SaveHandle(latest[0], self._name_for(latest[0]))
        committed = handle is not None and self._tiers.is_validated(handle.name)
        objection = agreed_plan(self._agreement, handle, busy, deadline, committed=committed)
        outcome = f"{drained}; {objection}"  # this rank objects where there is no handle
        if objection is None and handle is not None and latest is not None:
            self._ledger.record("requested", handle, tier="local")
            step, done = handle.step, handle.committed
            try:  # a failure is recorded by the save
                self._runner.foreground(handle, latest[1])
                how = f"synchronous save of step {step} committed"
                if not done.done() or done.exception() is not None:
                    how = f"save of step {step} did not verify"
            except BaseException as exc:
                how = f"save of step {step} failed: {exc}"
            outcome = f"{drained}; final {how}"
        self._ledger.record("preempted", handle or (None, None), reason=f"{reason}: {outcome}")
        # The process is about to go: its history appends with it, within what time is left.
        self._ledger.flush(max(0.0, deadline - time.monotonic()))
        log.warning("dcp_safe: preempted (%s): %s", reason, outcome)
        return outcome

    def in_flight(self) -> bool:
        """A save is in flight or pending."""
        return not self._slot.idle()
