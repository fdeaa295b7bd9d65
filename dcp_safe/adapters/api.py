"""``save`` / ``async_save`` / ``load``: DCP's calls, with deadlines and dcp_safe's errors.

They call ``torch.distributed.checkpoint`` unchanged, on dcp_safe's own gloo group (timeout
``deadline_s``; its creation, on the first call, is a collective every rank must make at the same
point) unless given ``process_group=`` or ``no_dist=``, and translate errors once, on the calling
thread and every future: DCP's ``CheckpointException`` and a dead peer's raw ``RuntimeError``
become :mod:`dcp_safe.errors` types naming the ranks (docs/multirank.md, "Deadlines, and why
saves get their own process group"). :func:`translate_errors` does it for plain DCP's calls.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

from dcp_safe.adapters.broadcast import deliver_shared
from dcp_safe.adapters.planners import SafeLoadPlanner, SafeSavePlanner
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.coordination.group import (
    DEFAULT_DEADLINE_S,
    checkpoint_group,
    collective_failure,
    deadline_of,
    discard_group,
    is_collective_failure,
    validate_deadline,
)
from dcp_safe.errors import CommitError, ConfigError, LoadError, from_checkpoint_exception
from dcp_safe.reading.audit import audit_load
from dcp_safe.torch_compat import dcp_async_save as _dcp_async_save
from dcp_safe.torch_compat import dcp_debug_logs_unheard, dcp_load_state_dict, storage_setup
from dcp_safe.torch_compat import dcp_save as _dcp_save

T = TypeVar("T")


# DCP warns on every single-process call, even when no_dist=True says so explicitly.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_resume = False  # the collector ran when the first holder paused it


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (reference counting still frees memory):
    what :func:`save` and :func:`load` run under (why, and what it saves: docs/architecture.md).

    A save of many small tensors makes several hundred thousand short-lived containers, each
    counting towards a full collection that walks every object of the process: at 10,000
    tensors of 32 KiB the collector took 0.2 to 0.4 s of a 1.5 s save (``gc.callbacks``).
    Only for the synchronous call: in a background one it would pause for the training thread
    too. Pauses nest across threads: the collector runs again when the last paused call ends,
    and only if it was running when the first began.
    """
    global _gc_holders, _gc_resume
    with _gc_lock:
        if _gc_holders == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_resume:
                gc.enable()


@dataclass(frozen=True)
class _Call:
    """What one call needs to explain a failed collective: its group, deadline and storage."""

    group: Any = None
    owned: bool = False
    deadline_s: float | None = None
    witnesses: tuple[object, ...] = ()
    # Taken when the call starts: after a failure the group may already be torn down.
    rank: int = 0
    world_size: int = 1
    operation: str = "save"
    checkpoint: str = "the checkpoint"  # what a load reads, for its errors

    def translate(self, exc: BaseException) -> BaseException:
        """The dcp_safe error for ``exc``; ``exc`` itself when it is none of ours to map."""
        if isinstance(exc, CheckpointException):
            error = from_checkpoint_exception(exc)
            if self.operation == "load" and isinstance(error, CommitError):
                # A rank's planner or reader raised: say the load failed, not that a save did.
                error = LoadError(self.checkpoint, error.failures)
                error.__cause__ = exc
            return error
        if self.group is not None and is_collective_failure(exc):
            # DCP wraps storage and planner errors in CheckpointException; what comes out bare
            # from a collective is the transport's (a peer gone, or the deadline passed).
            error = collective_failure(
                exc,
                rank=self.rank,
                world_size=self.world_size,
                deadline_s=self.deadline_s,
                witnesses=self.witnesses,
                operation=self.operation,
            )
            if self.owned:
                discard_group(self.group)
            return error
        return exc


@contextmanager
def _calling(call: _Call, kwargs: dict[str, Any]) -> Iterator[None]:
    """DCP's call: its errors translated, and quiet where it would warn for nothing."""
    # And DCP's per-key DEBUG records nobody hears (torch_compat.dcp_debug_logs_unheard).
    with warnings.catch_warnings(), dcp_debug_logs_unheard():
        if kwargs.get("no_dist"):
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        try:
            yield
        except (CheckpointException, RuntimeError) as exc:
            error = call.translate(exc)
            if error is exc:
                raise
            raise error from exc


@contextmanager
def translate_errors() -> Iterator[None]:
    """Plain ``dcp.save``, ``dcp.async_save`` (its futures' ``result()`` too) and ``dcp.load``,
    raising dcp_safe's errors as :func:`save`, :func:`async_save` and :func:`load` do.

    DCP wraps whatever a rank's writer, reader or planner raises in its ``CheckpointException``
    (a ``BaseException`` whose message starts ``CheckpointException ranks:``), and none of its
    arguments changes that. In this block one is replaced, with ``raise ... from``, by the same
    translation those calls make: the error the ranks raised (a missing bucket or a full disk:
    ``StorageError``, its message first), else a ``CommitError`` (a save) or ``LoadError`` (a
    load) naming each rank. Anything else passes unchanged::

        with dcp_safe.translate_errors():
            dcp.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    """
    try:
        yield
    except CheckpointException as exc:
        # DCP names the failed step ("plan", "write", "read"), not the call: its frames do.
        frames = [frame.filename for _, trace in exc.failures.values() for frame in trace or ()]
        loading = any(name.endswith("state_dict_loader.py") for name in frames)
        raise _Call(operation="load" if loading else "save").translate(exc) from exc


def _prepare(kwargs: dict[str, Any], deadline_s: float) -> _Call:
    """Fill in ``no_dist`` / ``process_group`` and say how to explain a failed collective."""
    deadline_s = validate_deadline(deadline_s)
    writer, reader = kwargs.get("storage_writer"), kwargs.get("storage_reader")
    checkpoint = str(kwargs.get("checkpoint_id") or _Call.checkpoint)
    call = _Call(operation="load" if writer is None else "save", checkpoint=checkpoint)
    distributed = dist.is_available() and dist.is_initialized()
    if kwargs.get("no_dist") or not distributed:
        # Say it explicitly rather than let DCP warn that it guessed.
        kwargs.setdefault("no_dist", not distributed)
        return call
    group = kwargs.get("process_group")
    owned = group is None
    if owned:
        group = kwargs["process_group"] = checkpoint_group(deadline_s)
    return dataclasses.replace(
        call,
        group=group,
        owned=owned,
        deadline_s=deadline_s if owned else deadline_of(group),
        witnesses=tuple(w for w in (writer, reader) if w is not None),
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
    )


def save(
    state_dict: dict[str, Any],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    per_rank: Sequence[str] = (),
    **kwargs: Any,
) -> Metadata:
    """``dcp.save`` (its keyword arguments passed on; without ``planner=``, a
    :class:`~dcp_safe.adapters.planners.SafeSavePlanner` plans) with a deadline and translated
    errors.

    ``deadline_s`` bounds how long any collective of this save waits for a peer (the dedicated
    group's timeout; ignored with ``process_group=`` or ``no_dist=True``): it must exceed the
    spread of per-rank write times. ``per_rank``: key prefixes saved once per rank. With
    ``use_collectives=False`` the ranks plan alone and agree through storage (docs/multirank.md,
    "Saves without collectives"): what stays collective is DCP's barrier after the save (bounded
    by ``deadline_s``) and, on the first call, creating the group; a rank that died is named by
    rank 0's ``CommitError`` within the writer's ``report_timeout_s``, and the other ranks learn
    of rank 0's failure from the barrier.

    Raises:
        CommitError: a rank failed, died or hung; ``failures`` names it. Nothing was published.
        DivergentStateError: ranks hold different values under one key not declared per rank.
        ConfigError: ``deadline_s`` is not a positive number.
    """
    call = _prepare_save(kwargs, per_rank, deadline_s)
    with _calling(call, kwargs), gc_paused():
        return cast(Metadata, _dcp_save(state_dict, **kwargs))


def load(
    state_dict: dict[str, Any],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    per_rank: Sequence[str] = (),
    audit: bool = False,
    **kwargs: Any,
) -> None:
    """``dcp.load`` into ``state_dict`` in place, with a deadline and translated errors as
    :func:`save` (a :class:`~dcp_safe.adapters.planners.SafeLoadPlanner` by default: with several
    ranks each entry they load identically is read once and sent to the others after DCP's load,
    its ``read_once``; docs/multirank.md, "Restores read each entry once").

    Args:
        per_rank: the key prefixes the checkpoint saved per rank: each rank gets its own.
        audit: after the load, check on every rank that the live tensors equal what was saved
            (:func:`dcp_safe.reading.audit.audit_load`); needs a ``SafeLoadPlanner``.

    Raises:
        MissingKeysError: the checkpoint lacks keys of ``state_dict``.
        PerRankStateError: per-rank entries were saved by another world size.
        RestoreMismatchError: ``audit`` found the live state differs from the saved one.
        LoadError: a rank's planner or reader failed (a shape that does not match, say);
            the message names the checkpoint, the rank and the cause.
    """
    if "planner" not in kwargs:
        kwargs["planner"] = SafeLoadPlanner(per_rank=per_rank)
    elif per_rank:
        raise ConfigError("per_rank= goes with dcp_safe's planner: pass SafeLoadPlanner(per_rank=)")
    planner = kwargs["planner"]
    if audit and not isinstance(planner, SafeLoadPlanner):
        raise ConfigError("audit=True needs a SafeLoadPlanner (or a subclass) as planner=")
    call = _prepare(kwargs, deadline_s)
    with _calling(call, kwargs), _sending(planner, kwargs, call), gc_paused():
        if isinstance(planner, SafeLoadPlanner) and planner.sends_shared:
            _load_and_share(state_dict, timeout_s=call.deadline_s, **kwargs)
        else:
            _dcp_load(state_dict, **kwargs)
        if audit:
            audit_load(planner, call.group)


@contextmanager
def _sending(planner: object, kwargs: dict[str, Any], call: _Call) -> Iterator[None]:
    """Let a ``SafeLoadPlanner`` plan entries read once, with several ranks: this call sends
    them (:func:`_load_and_share`). Not by default from a node cache: each node holds the files
    its own ranks wrote, so an entry's owner could be a rank that must fetch it from the remote.
    """
    if not isinstance(planner, SafeLoadPlanner):
        yield
        return
    reader = kwargs.get("storage_reader")
    cached = isinstance(reader, SafeStorageReader) and reader.node_cache is not None
    wanted = planner.read_once is True or (planner.read_once is None and not cached)
    # Entries travel as CPU buffers: a group without a CPU backend (NCCL alone) cannot send them.
    cpu = call.group is not None and "gloo" in str(dist.get_backend(call.group))
    planner.sends_shared = wanted and cpu and call.world_size > 1
    planner.bytes_received = 0
    try:
        yield
    finally:
        planner.sends_shared = False


def _load_and_share(
    state_dict: dict[str, Any],
    *,
    planner: SafeLoadPlanner,
    process_group: dist.ProcessGroup,
    timeout_s: float | None,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: StorageReader | None = None,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` (torch 2.13's ``state_dict_loader.load``, step for step, its private parts
    through :mod:`dcp_safe.torch_compat`) with the entries read once sent to the other ranks
    (:func:`~dcp_safe.adapters.broadcast.deliver_shared`) before the hand-over: the entries other
    ranks read for this one must arrive before each ``Stateful``'s ``load_state_dict`` runs. A
    peer lost while entries travel raises the transport's error within ``timeout_s``."""
    reader = cast(StorageReader, storage_setup(storage_reader, checkpoint_id, reader=True))
    keys = sorted(state_dict)  # as dcp.load: the same order on every rank
    loaded = {
        key: value.state_dict() if isinstance(value, Stateful) else value
        for key in keys
        for value in (state_dict[key],)
    }
    dcp_load_state_dict(loaded, reader, process_group, no_dist=no_dist, planner=planner)
    if planner.transfers:
        planner.bytes_received = deliver_shared(planner, process_group, timeout_s)
    for key in keys:
        value = state_dict[key]
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state_dict[key] = loaded[key]


def async_save(
    state_dict: dict[str, Any],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    per_rank: Sequence[str] = (),
    **kwargs: Any,
) -> Any:
    """``dcp.async_save`` as :func:`save` (without collectives, the background part waits on
    storage, not on the group, until DCP's barrier). Returns what DCP returns (an
    ``AsyncSaveResponse`` when the stager returns a future, else a future), each future replaced
    by one that carries the translated error. With ``async_checkpointer_type=PROCESS`` the upload
    runs in DCP's checkpoint process, on the group DCP creates there: ``deadline_s`` then bounds
    only the call itself.
    """
    call = _prepare_save(kwargs, per_rank, deadline_s)
    with _calling(call, kwargs):
        response = _dcp_async_save(state_dict, **kwargs)
    if isinstance(response, Future):
        return _translated(response, call)
    response.staging_completion = _translated(response.staging_completion, call)
    response.upload_completion = _translated(response.upload_completion, call)
    return response


def _prepare_save(kwargs: dict[str, Any], per_rank: Sequence[str], deadline_s: float) -> _Call:
    """A save's planner (dcp_safe's, unless given), sharing cached plans with every save over
    its group (docs/architecture.md), and its :class:`_Call`."""
    collective = kwargs.get("use_collectives", True) is not False
    if "planner" not in kwargs:
        # Without collectives every rank plans alone and reports its entries through storage:
        # a cached (itemless) local plan would hide them from that report.
        kwargs["planner"] = SafeSavePlanner(per_rank=per_rank, cache_plans=collective)
    elif per_rank:
        raise ConfigError("per_rank= goes with dcp_safe's planner: pass SafeSavePlanner(per_rank=)")
    call = _prepare(kwargs, deadline_s)
    if isinstance(kwargs["planner"], SafeSavePlanner) and collective:
        kwargs["planner"].share_plans_over(call.group)
    return call


def _translated(source: Future[T], call: _Call) -> Future[T]:
    target: Future[T] = Future()

    def forward(done: Future[T]) -> None:
        try:
            target.set_result(done.result())
        except BaseException as exc:
            # Every error translate makes is chained to exc (its __cause__) already.
            target.set_exception(call.translate(exc))

    source.add_done_callback(forward)
    return target
