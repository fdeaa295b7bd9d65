"""Run one function on several local CPU ranks, each a spawned process in a gloo process group.

``run_ranks(fn, world_size)`` is how dcp_safe's own tests (and a user's) exercise real
multi-rank DCP saves and loads on one machine with no launcher: every rank runs
``fn(rank, world_size, *args)`` inside an initialized default process group, and the parent
gets the return values in rank order, a :class:`RankFailedError` naming the first rank that
raised (with its remote traceback), or a :class:`RanksTimeoutError` naming the ranks that never
finished, after they were killed.

Why spawn and not fork: a forked child inherits the parent's threads' locks in whatever state
they were (torch's intra-op pool, gloo and store threads, pytest's capture and timeout
machinery) and an already-initialized torch, which deadlocks intermittently and is exactly what
a test harness must not do. A spawned rank starts from a fresh interpreter, as under
``torchrun``, and it may itself spawn (DCP's ``AsyncCheckpointerType.PROCESS`` starts a
checkpoint daemon per rank), which is why ranks are not ``daemon`` processes: a daemonic process
may not have children. The price is a fresh ``import torch`` per rank (a few seconds) and an
``fn`` that pickles by reference (a module-level function).

Why each rank leads its own process group: a rank's descendants (that same checkpoint daemon)
share it, so ``killpg`` on timeout or failure takes the whole tree down and leaves no orphans.
A rank also kills its group when the parent dies (its sentinel pipe closes), so a harness
killed by CI does not leave ranks behind either.

Why the rendezvous store lives in the parent: a ``TCPStore`` bound to port 0 gets its port from
the kernel, so there is no window between picking a free port and binding it. The ranks see the
usual ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` variables, as under ``torchrun``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context, parent_process
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

# torch re-exports TCPStore from torch._C without listing it, which strict mypy rejects.
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from dcp_safe.errors import DcpSafeError

__all__ = ["RankFailedError", "RanksTimeoutError", "run_ranks"]

HOST = "127.0.0.1"
# After one rank fails, how long its peers get to report (their own error, usually, once a
# collective sees the dead peer) before they are killed.
FAILURE_GRACE_S = 10.0
_JOIN_AFTER_KILL_S = 10.0


class RankFailedError(DcpSafeError):
    """A rank raised, or died without reporting a result.

    The remote traceback is this error's ``__cause__`` (as ``concurrent.futures`` does for
    process pools), so test reports show where the rank failed.

    Attributes:
        rank: the lowest failing rank.
        exc_type: the qualified name of the rank's exception ("" when the process died).
        remote_traceback: the formatted traceback from the rank ("" when the process died).
        exception: the rank's exception, when it pickled; else ``None``.
        exit_code: the process's exit code when it died without reporting; else ``None``.
        failures: every failing rank with a one-line description.
    """

    def __init__(
        self,
        rank: int,
        description: str,
        *,
        exc_type: str = "",
        remote_traceback: str = "",
        exception: BaseException | None = None,
        exit_code: int | None = None,
        failures: dict[int, str] | None = None,
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exception = exception
        self.exit_code = exit_code
        self.failures = dict(failures or {rank: description})
        others = "; ".join(f"rank {r}: {d}" for r, d in sorted(self.failures.items()) if r != rank)
        super().__init__(
            f"rank {rank} failed: {description}" + (f" (also {others})" if others else "")
        )


class RanksTimeoutError(DcpSafeError, TimeoutError):
    """Ranks still ran when the deadline passed; they (and their descendants) were killed.

    Attributes:
        ranks: the ranks that had not finished.
        timeout_s: the deadline that passed.
    """

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        self.ranks = tuple(ranks)
        self.timeout_s = timeout_s
        names = ", ".join(str(r) for r in self.ranks)
        super().__init__(f"ranks {names} still running after {timeout_s:g}s; killed them")


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


@dataclass(frozen=True)
class _Outcome:
    """What a rank sends back: a pickled value, or a description of its error."""

    value: bytes | None = None
    exc_type: str = ""
    message: str = ""
    remote_traceback: str = ""
    exception: bytes | None = None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    Each rank initializes the default process group (``backend`` on ``127.0.0.1``) before
    calling ``fn`` and destroys it afterwards. Whatever happens, every rank and every process
    it started is gone when this returns or raises.

    Args:
        fn: a module-level function (it is pickled by reference into each rank).
        world_size: the number of ranks, at least 1.
        args: extra positional arguments for ``fn``; they must pickle.
        timeout_s: the deadline for the whole run, from spawn to the last rank's exit.
        backend: the process group backend.

    Returns:
        Each rank's return value (which must pickle), in rank order.

    Raises:
        RankFailedError: a rank raised or died; names the lowest such rank.
        RanksTimeoutError: the deadline passed with ranks still running.
        ValueError: ``world_size`` below 1 or ``timeout_s`` not positive.
        pickle.PicklingError: ``fn`` or ``args`` do not pickle.
    """
    if world_size < 1 or timeout_s <= 0:
        raise ValueError(f"need world_size >= 1 and timeout_s > 0, got {world_size}, {timeout_s}")
    payload = pickle.dumps((fn, tuple(args)))
    deadline = time.monotonic() + timeout_s
    store = TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s))
    ctx = get_context("spawn")
    procs: list[BaseProcess] = []
    readers: list[connection.Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, payload, store.port, backend, timeout_s, writer),
                name=f"dcp_safe-rank-{rank}",
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        outcomes, running = _collect(procs, readers, deadline)
    finally:
        _kill_all(procs)
        for reader in readers:
            reader.close()
        del store
    return _results(outcomes, running, procs, timeout_s)


def _collect(
    procs: Sequence[BaseProcess], readers: Sequence[connection.Connection], deadline: float
) -> tuple[dict[int, _Outcome], list[int]]:
    """Read outcomes until every rank exited, the deadline passed, or a failure's grace ran out.

    Returns the outcomes by rank and the ranks whose processes were still running.
    """
    outcomes: dict[int, _Outcome] = {}
    pending = {reader: rank for rank, reader in enumerate(readers)}
    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    failed = False
    while alive and (remaining := deadline - time.monotonic()) > 0:
        for ready in connection.wait([*pending, *alive], timeout=remaining):
            if isinstance(ready, int):
                rank = alive.pop(ready)
                _drain(readers[rank], rank, pending, outcomes)
                failed = failed or rank not in outcomes
            elif ready in pending:
                rank = pending[ready]
                _drain(ready, rank, pending, outcomes)
                failed = failed or rank not in outcomes or outcomes[rank].value is None
        if failed:
            # Peers of a failed rank usually fail too once a collective sees it gone; give
            # them a bounded while to say so, then they are killed.
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            failed = False
    return outcomes, sorted(alive.values())


def _drain(
    reader: connection.Connection,
    rank: int,
    pending: dict[connection.Connection, int],
    outcomes: dict[int, _Outcome],
) -> None:
    if reader not in pending:
        return
    with contextlib.suppress(EOFError, OSError):
        if reader.poll():
            outcomes[rank] = pickle.loads(reader.recv_bytes())
    del pending[reader]


def _results(
    outcomes: dict[int, _Outcome],
    running: list[int],
    procs: Sequence[BaseProcess],
    timeout_s: float,
) -> list[Any]:
    failures: dict[int, str] = {}
    for rank, proc in enumerate(procs):
        outcome = outcomes.get(rank)
        if outcome is not None and outcome.value is None:
            failures[rank] = f"{outcome.exc_type}: {outcome.message}"
        elif outcome is None and rank not in running:
            failures[rank] = f"process died with exit code {proc.exitcode} and no result"
    if failures:
        first = min(failures)
        for rank in running:
            failures.setdefault(rank, f"still running after rank {first} failed; killed")
        raise _failed(first, failures, outcomes, procs)
    if running:
        raise RanksTimeoutError(running, timeout_s)
    return [pickle.loads(outcomes[rank].value or b"") for rank in range(len(procs))]


def _failed(
    rank: int, failures: dict[int, str], outcomes: dict[int, _Outcome], procs: Sequence[BaseProcess]
) -> RankFailedError:
    outcome = outcomes.get(rank)
    if outcome is None:
        return RankFailedError(
            rank, failures[rank], exit_code=procs[rank].exitcode, failures=failures
        )
    exception: BaseException | None = None
    if outcome.exception is not None:
        with contextlib.suppress(Exception):
            exception = pickle.loads(outcome.exception)
    error = RankFailedError(
        rank,
        failures[rank],
        exc_type=outcome.exc_type,
        remote_traceback=outcome.remote_traceback,
        exception=exception,
        failures=failures,
    )
    error.__cause__ = _RemoteTraceback(outcome.remote_traceback)
    return error


def _kill_all(procs: Sequence[BaseProcess]) -> None:
    """SIGKILL every rank's process group (its descendants too), then reap the ranks.

    A rank that exited is not reaped yet (only its sentinel fired), so its pid, and with it its
    group id, cannot have been reused: killing the group is safe and takes down anything the
    rank left behind.
    """
    for proc in procs:
        if proc.pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.exitcode is None:
            # Killed before it made itself a group leader: the group above is not its own.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        if proc.pid is not None:
            proc.join(_JOIN_AFTER_KILL_S)


# ----------------------------------------------------------------------------- in the rank


def _rank_main(
    rank: int,
    world_size: int,
    payload: bytes,
    store_port: int,
    backend: str,
    timeout_s: float,
    out: connection.Connection,
) -> None:
    os.setpgid(0, 0)
    _die_with_parent()
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(store_port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        fn, args = pickle.loads(payload)
        value = _call_in_group(fn, rank, world_size, args, store_port, backend, timeout_s)
        outcome = _Outcome(value=pickle.dumps(value))
    except BaseException as exc:  # pytest.fail() and friends derive from BaseException
        outcome = _describe(exc)
    # Plain pickle, not the multiprocessing pickler: torch registers reducers there that pass
    # tensors as shared-memory handles, which die with this process.
    out.send_bytes(pickle.dumps(outcome))
    out.close()


def _call_in_group(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    store_port: int,
    backend: str,
    timeout_s: float,
) -> Any:
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(HOST, store_port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        return fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _describe(exc: BaseException) -> _Outcome:
    exception: bytes | None = None
    with contextlib.suppress(Exception):
        exception = pickle.dumps(exc)
    return _Outcome(
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        remote_traceback="".join(traceback.format_exception(exc)),
        exception=exception,
    )


def _die_with_parent() -> None:
    """Kill this rank's process group when the parent dies, so no rank outlives its harness."""
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="dcp_safe-parent-watch", daemon=True).start()
