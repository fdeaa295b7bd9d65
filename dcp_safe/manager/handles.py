"""The manager's vocabulary: its modes, the handle of one save, and its counters.

These are the types a caller of :class:`~dcp_safe.manager.CheckpointManager` sees; the modes'
docstrings say what each one does.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "BusyPolicy",
    "ManagerStats",
    "Pending",
    "SaveHandle",
    "StagingMode",
    "Validation",
    "chain",
]

T = TypeVar("T")


class BusyPolicy(str, enum.Enum):
    """What :meth:`CheckpointManager.save` does while a save is in flight.

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

    * ``"snapshot"`` (default): ``save`` returns once the state is copied into the stager's buffers,
      so the caller may update it in place at once; the training pause is that bounded copy. The
      handle's ``staged`` future is already done.
    * ``"overlap"``: ``save`` returns as soon as the copy has started, so the copy overlaps the
      caller's next compute. The caller must then wait (``handle.staged.result()`` or
      :meth:`CheckpointManager.wait_staged`) before the first in-place update of the state: the
      optimizer step, but also in-place updates during the forward pass, such as BatchNorm's running
      statistics. The stager's mutation guard fails a save whose state changed during the copy
      (:class:`~dcp_safe.errors.SnapshotMutatedError`, recorded in the history) rather than commit a
      torn checkpoint, but it cannot see every kind of update (docs/staging.md).
    """

    SNAPSHOT = "snapshot"  # after the copy: the caller may mutate the state at once
    OVERLAP = "overlap"  # after the copy started: the caller waits on ``staged`` before mutating


class Validation(str, enum.Enum):
    """How a new local checkpoint is checked before retention may prune older ones.

    The check is the one :func:`~dcp_safe.checkpoints.catalog.verify_checkpoint` runs (``DEEP`` is
    its ``deep=True``; ``MANIFEST`` is the marker-against-manifest part of its quick check), chosen
    once for every save; the reader's ``verify=`` checks the bytes a load reads, as it reads them.
    """

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
    """Counters since the manager was created (this rank's; equal on every rank).

    ``waits_expired`` counts ``when_busy="wait"`` requests skipped at ``wait_timeout_s``;
    ``groups_broken`` the failures that broke one of the manager's gloo groups (replaced at the
    next request); ``bookkeeping_failures`` the history appends and telemetry calls that failed
    (logged; the saves they were about are unaffected).
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


@dataclass
class Pending:
    """A coalesced save, parked: its private copy of the state, and its place in the ranks'
    agreed sequence of coalesce decisions (``seq``: the same on every rank)."""

    handle: SaveHandle
    state: dict[str, Any]
    nbytes: int
    seq: int = 0


def chain(source: Future[Any], target: Future[T], convert: Callable[[Any], T]) -> None:
    def forward(done: Future[Any]) -> None:
        with contextlib.suppress(InvalidStateError):  # a failure recorded it first
            try:
                target.set_result(convert(done.result()))
            except CancelledError:
                target.cancel()
            except BaseException as exc:
                target.set_exception(exc)

    source.add_done_callback(forward)
