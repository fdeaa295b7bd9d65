"""Where a manager's background saves run: a worker process where one applies, else a thread.

``executor="auto"`` (the default) takes the worker process (``"process"``: the write, checksum,
commit, its check and replication out of the training process's interpreter lock; docs/staging.md,
"The process executor") wherever every one of its needs holds, and a thread of the training
process otherwise, logging why once. ``"process"`` insists: a need that does not hold is a
:class:`~dcp_safe.errors.ConfigError` before anything starts. ``"thread"`` is the thread.

The needs are the same on every rank of a job (one platform, one store, one writer class), so the
ranks choose alike; a job mixing executors across ranks would save over different groups.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Literal

import torch.distributed as dist

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.coordination.worker_group import store_address
from dcp_safe.errors import ConfigError
from dcp_safe.staging import BudgetedStager
from dcp_safe.torch_compat import default_store

__all__ = ["EXECUTORS", "Executor", "choose_executor"]

Executor = Literal["thread", "process"]
EXECUTORS = ("auto", "thread", "process")

log = logging.getLogger("dcp_safe.manager")


def choose_executor(
    executor: str,
    stager: BudgetedStager | None,
    writer: SafeStorageWriter,
    *,
    writer_given: bool,
) -> Executor:
    """The executor ``executor`` names for a manager with ``stager`` (``None``: its own) and
    ``writer`` (``writer_given``: the caller's, not one the manager built).

    ``"auto"`` leaves a writer of the caller's on a thread: the worker would run a pickled copy
    of it, and whatever it does to objects of this process (counters, callbacks, events) would
    silently stop happening. ``"process"`` sends it all the same.

    Raises:
        ConfigError: an unknown executor, or ``"process"`` where one of its needs does not hold
            (the message names it).
    """
    if executor not in EXECUTORS:
        raise ConfigError(
            f"executor must be one of {', '.join(map(repr, EXECUTORS))}, got {executor!r}"
        )
    if executor == "thread":
        return "thread"
    if executor == "auto" and writer_given:
        unmet: str | None = "the writer is the caller's (executor='process' runs a copy of it)"
    else:
        unmet = unmet_need(stager, writer)
    if unmet is None:
        return "process"
    if executor == "process":
        raise ConfigError(unmet)
    log.info("executor='auto' chose 'thread': %s", unmet)
    return "thread"


def unmet_need(stager: BudgetedStager | None, writer: SafeStorageWriter) -> str | None:
    """What ``executor="process"`` needs and does not have here, in a sentence (``None``:
    nothing)."""
    if not hasattr(os, "memfd_create"):
        return "executor='process' needs os.memfd_create (Linux) for the slabs it shares"
    if stager is not None and stager.shared is None:
        return "executor='process' needs a stager built with shared_memory=True"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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
