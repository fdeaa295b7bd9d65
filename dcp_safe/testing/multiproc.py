"""Run one function on several local CPU ranks, each its own process in a gloo process group.

``run_ranks(fn, world_size)`` is how dcp_safe's own tests (and a user's) exercise real
multi-rank DCP saves and loads on one machine with no launcher: every rank runs
``fn(rank, world_size, *args)`` inside an initialized default process group, and the parent
gets the return values in rank order, a :class:`RankFailedError` naming the first rank that
raised (with its remote traceback), or a :class:`RanksTimeoutError` naming the ranks that never
finished, after they were killed. Both errors carry the values of the ranks that did return
(``results``), so a test can kill or stop one rank on purpose and check what its peers saw.

A rank stopped by a signal (``SIGSTOP``: how a test simulates a hung peer) can never finish, so
once every other rank has reported, the stopped ones count as failed and are killed rather than
waited for until the deadline (detected through ``/proc``, so on Linux only; elsewhere the
deadline catches them).

Why ranks are forked from a fork server that has imported torch: :mod:`~.rank_start`. A rank
may spawn (DCP's ``AsyncCheckpointerType.PROCESS`` starts a daemon per rank), so ranks are not
``daemon`` processes (those may not have children). ``fn`` must pickle by reference.

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
import gc
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, parent_process
from multiprocessing.process import BaseProcess
from typing import Any, cast

import torch.distributed as dist

# torch re-exports TCPStore from torch._C without listing it, which strict mypy rejects.
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from dcp_safe.errors import DcpSafeError
from dcp_safe.testing.rank_start import StdStreams, rank_context

__all__ = ["RankFailedError", "RanksTimeoutError", "run_ranks"]

HOST = "127.0.0.1"
# After one rank fails, how long its peers get to report (their own error, usually, once a
# collective sees the dead peer) before they are killed.
FAILURE_GRACE_S = 10.0
_JOIN_AFTER_KILL_S = 10.0
# How often the parent looks for stopped ranks while it waits.
_POLL_S = 0.25
_FINISHED_KEY = "dcp_safe/run_ranks/finished"
_ALL_FINISHED_KEY = "dcp_safe/run_ranks/all_finished"


class RankFailedError(DcpSafeError):
    """A rank raised, or died without reporting a result.

    The remote traceback is this error's ``__cause__`` (as ``concurrent.futures`` does for
    process pools), so test reports show where the rank failed.

    Attributes:
        rank: the rank that failed first (its peers often fail only because it did).
        exc_type: the qualified name of the rank's exception ("" when the process died).
        remote_traceback: the formatted traceback from the rank ("" when the process died).
        exception: the rank's exception, when it pickled; else ``None``.
        exit_code: the process's exit code when it died without reporting; else ``None``.
        failures: every failing rank with a one-line description.
        results: the return values of the ranks that did return, by rank.
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
        results: dict[int, Any] | None = None,
    ) -> None:
        self.rank = rank
        self.results = dict(results or {})
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
        results: the return values of the ranks that did return, by rank.
    """

    def __init__(
        self, ranks: Sequence[int], timeout_s: float, results: dict[int, Any] | None = None
    ) -> None:
        self.ranks = tuple(ranks)
        self.results = dict(results or {})
        self.timeout_s = timeout_s
        names = ", ".join(str(r) for r in self.ranks)
        which = f"rank {names}" if len(self.ranks) == 1 else f"ranks {names}"
        super().__init__(f"{which} still running after {timeout_s:g}s; killed every rank")


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


@dataclass(frozen=True)
class _Payload:
    """What a rank runs: ``(fn, args)`` pickled, where ``fn``'s module lives, and the caller's
    environment and stdout/stderr at the call (``streams``: ``None`` once taken in the rank)."""

    fn_and_args: bytes
    module: str
    module_file: str | None
    environ: dict[str, str]
    streams: StdStreams | None


@dataclass(frozen=True)
class _Outcome:
    """What a rank sends back: a pickled value, or a description of its error."""

    value: bytes | None = None
    exc_type: str = ""
    message: str = ""
    remote_traceback: str = ""
    exception: bytes | None = None
    # time.monotonic() when the rank failed: CLOCK_MONOTONIC is system-wide on Linux, so
    # failures of different ranks (and the parent's observations) can be ordered.
    failed_at: float = 0.0
    # Set by the parent for a rank it gave up on (a stopped process), saying why.
    note: str = ""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
    failure_grace_s: float = FAILURE_GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    Each rank initializes the default process group (``backend`` on ``127.0.0.1``, with
    ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set as ``torchrun`` sets them) before
    calling ``fn``, waits for every peer to finish ``fn``, destroys the group and ends with
    ``os._exit`` (so ``atexit`` handlers registered in a rank do not run). Ranks inherit this
    process's stdout, stderr and ``sys.path``. Whatever happens, every rank and every process
    it started is gone when this returns or raises.

    Args:
        fn: a module-level function (it is pickled by reference into each rank; its module is
            imported there by name, also when pytest's importlib import mode registered it
            under a name no ``sys.path`` entry provides).
        world_size: the number of ranks, at least 1.
        args: extra positional arguments for ``fn``; they must pickle.
        timeout_s: the deadline for the whole run, from spawn to the last rank's exit.
        backend: the process group backend.
        failure_grace_s: after a rank fails, how long its peers get to finish (a test that
            kills a rank on purpose gives its peers' deadlines room here).

    Returns:
        Each rank's return value (which must pickle), in rank order.

    Raises:
        RankFailedError: a rank raised, died or was stopped; names the rank that failed first.
            Its peers get ``failure_grace_s`` to finish or fail too, then they are killed.
        RanksTimeoutError: the deadline passed with ranks still running.
        ValueError: ``world_size`` below 1 or ``timeout_s`` not positive.
        pickle.PicklingError: ``fn`` or ``args`` do not pickle.
    """
    if world_size < 1 or timeout_s <= 0 or failure_grace_s < 0:
        raise ValueError(
            "need world_size >= 1, timeout_s > 0 and failure_grace_s >= 0, got "
            f"{world_size}, {timeout_s}, {failure_grace_s}"
        )
    payload = _Payload(
        pickle.dumps((fn, tuple(args))),
        fn.__module__,
        _module_file(fn),
        dict(os.environ),
        StdStreams(),
    )
    deadline = time.monotonic() + timeout_s
    store = TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s))
    ctx = rank_context()
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
        outcomes, running = _collect(procs, readers, deadline, failure_grace_s)
    finally:
        _kill_all(procs)
        for reader in readers:
            reader.close()
        del store
    return _results(outcomes, running, procs, timeout_s)


def _collect(
    procs: Sequence[BaseProcess],
    readers: Sequence[connection.Connection],
    deadline: float,
    failure_grace_s: float,
) -> tuple[dict[int, _Outcome], list[int]]:
    """Read outcomes until every rank exited, the deadline passed, or a failure's grace ran out.

    Returns the outcomes by rank and the ranks whose processes were still running.
    """
    outcomes: dict[int, _Outcome] = {}
    pending = {reader: rank for rank, reader in enumerate(readers)}
    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    failed = False
    while alive and (remaining := deadline - time.monotonic()) > 0:
        if failed and len(outcomes) == len(procs):
            break  # everyone has spoken; no need to watch the survivors exit
        ready_list = connection.wait([*pending, *alive], timeout=min(remaining, _POLL_S))
        for ready in ready_list:
            if isinstance(ready, int):
                rank = alive.pop(ready)
            else:
                rank = pending[cast(connection.Connection, ready)]
            _drain(readers[rank], rank, pending, outcomes)
            failed = failed or outcomes[rank].value is None
        if not ready_list and _give_up_on_stopped(procs, pending, outcomes):
            failed = True
        if failed and deadline > (grace_end := time.monotonic() + failure_grace_s):
            # Peers of a failed rank usually fail too once a collective sees it gone; give
            # them a bounded while to say so, then they are killed.
            deadline = grace_end
    return outcomes, sorted(alive.values())


def _give_up_on_stopped(
    procs: Sequence[BaseProcess],
    pending: dict[connection.Connection, int],
    outcomes: dict[int, _Outcome],
) -> bool:
    """When every rank yet to report is stopped (SIGSTOP), record them as failed. True if so.

    Only then: a rank stopped for a moment while its peers still work may be resumed; once
    nobody else is left to resume it, nothing will.
    """
    if not pending or not all(_is_stopped(procs[rank].pid) for rank in pending.values()):
        return False
    now = time.monotonic()
    for reader, rank in list(pending.items()):
        note = "process stopped by a signal (SIGSTOP) with no result; killed"
        outcomes[rank] = _Outcome(failed_at=now, note=note)
        del pending[reader]
    return True


def _is_stopped(pid: int | None) -> bool:
    """True when ``pid`` is in the stopped state (Linux ``/proc``; False where unknown)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return False
    return bool(fields) and fields[0] in ("T", "t")


def _drain(
    reader: connection.Connection,
    rank: int,
    pending: dict[connection.Connection, int],
    outcomes: dict[int, _Outcome],
) -> None:
    """Read a rank's outcome once: when its pipe is readable, or when its process exited."""
    if reader not in pending:
        return
    try:
        outcomes[rank] = pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        # Exited (or closed the pipe) without a word: a crash, os._exit, or a kill.
        outcomes[rank] = _Outcome(failed_at=time.monotonic())
    del pending[reader]


def _results(
    outcomes: dict[int, _Outcome],
    running: list[int],
    procs: Sequence[BaseProcess],
    timeout_s: float,
) -> list[Any]:
    failed = {r: o for r, o in outcomes.items() if o.value is None}
    returned = _returned(outcomes, strict=not failed)
    if failed:
        first = min(failed, key=lambda r: (failed[r].failed_at, r))
        failures = {r: _summary(o, procs[r]) for r, o in sorted(failed.items())}
        for rank in running:
            if rank not in outcomes:
                failures[rank] = f"still running after rank {first} failed; killed"
        raise _failed(first, failures, outcomes[first], procs[first], returned)
    if running:
        # Name the ranks still inside ``fn``; those that returned wait for them to leave.
        still = [r for r in running if r not in outcomes] or running
        raise RanksTimeoutError(still, timeout_s, returned)
    return [returned[rank] for rank in range(len(procs))]


def _returned(outcomes: dict[int, _Outcome], *, strict: bool) -> dict[int, Any]:
    """The values of the ranks that returned; when not ``strict``, those that unpickle here."""
    values: dict[int, Any] = {}
    for rank, outcome in sorted(outcomes.items()):
        if outcome.value is None:
            continue
        try:
            values[rank] = pickle.loads(outcome.value)
        except Exception:
            if strict:
                raise
    return values


def _summary(outcome: _Outcome, proc: BaseProcess) -> str:
    if outcome.note:
        return outcome.note
    if outcome.exc_type:
        return f"{outcome.exc_type}: {outcome.message}"
    return f"process died with exit code {proc.exitcode} and no result"


def _failed(
    rank: int,
    failures: dict[int, str],
    outcome: _Outcome,
    proc: BaseProcess,
    results: dict[int, Any],
) -> RankFailedError:
    if not outcome.exc_type:
        return RankFailedError(
            rank, failures[rank], exit_code=proc.exitcode, failures=failures, results=results
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
        results=results,
    )
    error.__cause__ = _RemoteTraceback(outcome.remote_traceback)
    return error


def _kill_all(procs: Sequence[BaseProcess]) -> None:
    """SIGKILL every rank's process group (its descendants too); return once they are gone.

    A rank's group outlives it while anything the rank left behind runs, so its id cannot have
    been reused then; an empty group is gone (a fork server reaps its children at once, and a
    pid comes back into use only after the kernel has gone round every other): killing the
    group is safe and takes down anything the rank left behind. Descendants are not this
    process's children, so their end is observed by polling their group (with signal 0) until
    the kernel has removed it, within a bound.
    """
    pids = [proc.pid for proc in procs if proc.pid is not None]
    for proc in procs:
        if proc.pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
            # SIGKILL ends a stopped process too; SIGCONT only makes sure no stopped
            # descendant lingers where a kill is delivered late.
            os.killpg(proc.pid, signal.SIGCONT)
        if proc.exitcode is None:
            # Killed before it made itself a group leader: the group above is not its own.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        if proc.pid is not None:
            proc.join(_JOIN_AFTER_KILL_S)
    deadline = time.monotonic() + _JOIN_AFTER_KILL_S
    while any(map(_group_exists, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# ----------------------------------------------------------------------------- in the rank


def _rank_main(
    rank: int,
    world_size: int,
    payload: _Payload,
    store_port: int,
    backend: str,
    timeout_s: float,
    out: connection.Connection,
) -> None:
    os.setpgid(0, 0)
    gc.freeze()  # the fork server's torch objects: a stager's gc.collect() on close skips them
    _die_with_parent()
    os.environ.clear()
    os.environ.update(payload.environ)
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(store_port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        _import_by_name(payload.module, payload.module_file)
        fn, args = pickle.loads(payload.fn_and_args)
        store = _join_group(rank, world_size, store_port, backend, timeout_s)
        try:
            # Report at once, before this rank's connections close: peers notice a failure
            # only after that, so the failure that causes theirs is always stamped first.
            outcome = _call(fn, rank, world_size, args)
            _send(out, outcome)
            _leave_together(store, world_size, wait=outcome.value is not None)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # pytest.fail() and friends derive from BaseException
        _send(out, _describe(exc))
    # Skip interpreter teardown: unloading torch takes seconds on a busy machine, and nothing
    # in it matters here (the outcome is sent, the group destroyed, and the harness kills
    # whatever this rank started). atexit handlers of ``fn`` therefore do not run.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _module_file(fn: Callable[..., Any]) -> str | None:
    module = sys.modules.get(fn.__module__)
    return getattr(module, "__file__", None)


def _import_by_name(name: str, path: str | None) -> None:
    """Make ``fn``'s module importable here, and in any process this rank spawns, by its name.

    Usually a plain import does it. pytest's ``--import-mode=importlib`` registers a test
    module under a name derived from its path (``tests.storage.test_x``) that no ``sys.path``
    entry provides: then the directory that name is relative to joins ``sys.path`` (last, so it
    shadows nothing). A rank's own children (DCP's checkpoint process) inherit ``sys.path``, so
    classes defined in that module unpickle there too. Failing that, the module is loaded from
    its file under its name, for this process only.
    """
    if name == "__main__" or name in sys.modules or path is None:
        return  # spawn already re-ran the parent's main module
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
        return
    root = _root_for(name, path)
    if root is not None:
        sys.path.append(root)
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
            return
        sys.path.remove(root)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return  # unpickling fn will then say what is missing
    module = importlib.util.module_from_spec(spec)
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _root_for(name: str, path: str) -> str | None:
    """``/r`` for module ``a.b.c`` at ``/r/a/b/c.py``; None when the path does not end so."""
    parts = name.split(".")
    here = os.path.splitext(os.path.abspath(path))[0]
    for part in reversed(parts):
        here, tail = os.path.split(here)
        if tail != part:
            return None
    return here


def _join_group(rank: int, world_size: int, store_port: int, backend: str, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(HOST, store_port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # Gloo's mesh is not necessarily up on every rank when init returns here, and a rank that
    # ran on and exited would break a peer's connect ("Connection closed by peer").
    dist.barrier()
    return store


def _call(fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...]) -> _Outcome:
    try:
        return _Outcome(value=pickle.dumps(fn(rank, world_size, *args)))
    except BaseException as exc:
        return _describe(exc)


def _leave_together(store: Any, world_size: int, *, wait: bool) -> None:
    """Tear down only once every rank is done with ``fn``, so no peer loses a connection mid-use.

    A failed rank does not wait: its peers may be blocked in a collective it will never join,
    and only its exit unblocks them.
    """
    if store.add(_FINISHED_KEY, 1) == world_size:
        store.set(_ALL_FINISHED_KEY, "1")
    if wait:
        store.wait([_ALL_FINISHED_KEY])


def _send(out: connection.Connection, outcome: _Outcome) -> None:
    """Send the first outcome; later ones (an error while tearing down) are dropped."""
    if out.closed:
        return
    # Plain pickle, not the multiprocessing pickler: torch registers reducers there that pass
    # tensors as shared-memory handles, which die with this process.
    out.send_bytes(pickle.dumps(outcome))
    out.close()


def _describe(exc: BaseException) -> _Outcome:
    exception: bytes | None = None
    with contextlib.suppress(Exception):
        exception = pickle.dumps(exc)
    return _Outcome(
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        remote_traceback="".join(traceback.format_exception(exc)),
        exception=exception,
        failed_at=time.monotonic(),
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
