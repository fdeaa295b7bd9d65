"""The types a caller of :class:`~dcp_safe.manager.CheckpointManager` sees: modes, handle, stats."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from dcp_safe.errors import ConfigError
from dcp_safe.manifest.schema import check_metrics


class BusyPolicy(str, enum.Enum):
    """What :meth:`CheckpointManager.save` does while a save is in flight.

    * ``"wait"``: block until it is done; the seconds are counted in :meth:`stats`.
    * ``"skip"``: return ``None``; counted, logged, and recorded in the history.
    * ``"coalesce"``: keep only the newest request, copied *now* into one extra host copy if the
      stager's budget has room for it besides the pool (else skipped). A newer request replaces
      the pending one, whose handle's futures are cancelled; the manager thread saves it as soon
      as the save in flight is done.
    * ``"sync"``: save the live state now, in the foreground, without staging.
    * ``"raise"``: raise :class:`~dcp_safe.errors.AdmissionTimeoutError` (a wait of zero).

    Not the stager's :class:`~dcp_safe.staging.options.WhenBusy`, which decides what its
    ``stage()`` does when the memory budget or ``max_in_flight`` leaves no room yet.
    """

    WAIT = "wait"
    SKIP = "skip"
    COALESCE = "coalesce"
    SYNC = "sync"
    RAISE = "raise"


class StagingMode(str, enum.Enum):
    """When :meth:`CheckpointManager.save` returns relative to the copy of the state.

    * ``"snapshot"`` (default): ``save`` returns once the state is copied into the stager's
      buffers (``handle.staged`` is done), so the caller may update it in place at once.
    * ``"overlap"``: ``save`` returns as soon as the copy has started. The caller must wait
      (``handle.staged.result()`` or :meth:`CheckpointManager.wait_staged`) before the first
      in-place update of the state, BatchNorm's running statistics in the forward pass included.
      The mutation guard fails a save whose state changed during the copy
      (:class:`~dcp_safe.errors.SnapshotMutatedError`), but cannot see every kind of update
      (docs/staging.md).
    """

    SNAPSHOT = "snapshot"
    OVERLAP = "overlap"


class Validation(str, enum.Enum):
    """How a new local checkpoint is checked before retention may prune older ones.

    ``DEEP`` is :func:`~dcp_safe.checkpoints.catalog.verify_checkpoint`; ``MANIFEST`` the
    marker-against-manifest part of its quick check. Loads check what they read regardless.
    """

    MANIFEST = "manifest"  # marker and manifest digest agree (a few small reads)
    DEEP = "deep"  # every byte against its checksum (verify_checkpoint)


@dataclass(frozen=True)
class SaveHandle:
    """One requested save.

    Attributes:
        staged: resolves once the state was copied (the caller may mutate it again); already
            done when ``save`` returns with the default ``staging="snapshot"``.
        committed: resolves with ``name`` once committed locally, verified, and retention ran;
            fails with the upload's or verification's error; cancelled if a newer coalesced
            request replaced this one.
        replicated: resolves once committed on ``replicate_to`` (``None`` without one), with
            the replica's manifest (the process executor: its ``CommittedHeader``; ``None`` on a
            rank whose own wait gave up before rank 0's remote commit, which rank 0's verdict
            says landed).
        metrics: what the save records in its manifest and history (checked here:
            :func:`~dcp_safe.manifest.schema.check_metrics`; ``ConfigError`` if not).
    """

    step: int
    name: str
    staged: Future[None] = field(default_factory=Future, repr=False)
    committed: Future[str] = field(default_factory=Future, repr=False)
    replicated: Future[Any] = field(default_factory=Future, repr=False)
    metrics: Mapping[str, float | str] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.metrics is not None:
            try:
                object.__setattr__(self, "metrics", check_metrics(self.metrics))
            except ValueError as exc:
                raise ConfigError(f"save(metrics=...): {exc}") from None

    def cancel(self) -> None:
        for future in (self.staged, self.committed, self.replicated):
            future.cancel()


def settle(futures: Iterable[Future[Any]], error: BaseException) -> None:
    """Fail each of ``futures`` with ``error``; one done already (or cancelled) stays as it is."""
    for future in futures:
        with contextlib.suppress(InvalidStateError):
            future.set_exception(error)


@dataclass(frozen=True)
class ManagerStats:
    """Counters since the manager was created (this rank's; equal on every rank).

    ``waits_expired`` counts ``when_busy="wait"`` requests skipped at ``wait_timeout_s``;
    ``groups_broken`` the failures that broke one of the manager's gloo groups (replaced at the
    next request); ``bookkeeping_failures`` the history appends and telemetry calls that failed
    (logged; the saves they were about are unaffected); ``peer_copies`` and
    ``peer_copy_failures`` the committed saves whose peer copies (``peer_copies=``) completed or
    failed (the failure is also raised by ``wait``/``close``; the save stays committed);
    ``worker_saves`` the saves started in the checkpoint worker process (the others ran on a
    thread: ``executor="thread"``, or while the worker was starting).

    ``save_interval_s`` is the interval between saves (``auto``'s choice, agreed at the last
    vote; ``interval_s``; or the time measured between commits), ``interval_reason`` why,
    ``expected_loss_per_hour_s`` the work failures lose per hour at it (``None`` where the MTBF
    is unknown), ``save_cost_s`` and ``mtbf_s`` what it came from (docs/manager.md).
    """

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
    waits_expired: int = 0
    groups_broken: int = 0
    bookkeeping_failures: int = 0
    peer_copies: int = 0
    peer_copy_failures: int = 0
    worker_saves: int = 0
    save_interval_s: float | None = None
    interval_reason: str = "no save committed yet"
    expected_loss_per_hour_s: float | None = None
    save_cost_s: float | None = None
    mtbf_s: float | None = None


@dataclass
class Pending:
    """A coalesced save, parked: its private copy of the state, its place in the ranks'
    agreed sequence of coalesce decisions (``seq``: the same on every rank), and whether the
    ranks agreed to run it in their checkpoint workers (``worker``)."""

    handle: SaveHandle
    state: dict[str, Any]
    nbytes: int
    seq: int = 0
    worker: bool = False
