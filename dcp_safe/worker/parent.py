"""``SaveWorker``: the parent's side of the checkpoint worker (``executor="process"``).

One persistent worker process per rank (:mod:`dcp_safe.worker.main`), started by the first save
request without waiting for it and reused; until every rank's is :attr:`~SaveWorker.ready` the
ranks save on the thread path (docs/staging.md, "The process executor"). A sender thread hands
the worker each staged state (by place: :mod:`dcp_safe.worker.transport`) and any slab it has
not mapped yet; a reader thread resolves each save's future from the reply, and the staged state
stays referenced here until then (its buffers are not reused under the worker's write). A worker
that dies fails every save it held with :class:`~dcp_safe.errors.WorkerDiedError`.

With several ranks the workers save over a group of their own
(:mod:`dcp_safe.coordination.worker_group`). A death, or a failure of that group, marks it broken;
the ranks replace it at their next vote, and each rank's next save then retires its worker and
starts one of the new generation. Until that vote a save here fails at once rather than wait for
peers in a group that is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.coordination.worker_group import WorkerGroup, WorkerGroups
from dcp_safe.errors import CommitError, WorkerDiedError
from dcp_safe.staging.shared import SharedSlabs
from dcp_safe.worker.boot import BEAT_S
from dcp_safe.worker.transport import Checked, StateEncoder, decode_error

_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
# The fewest beats a worker may miss before its parent kills it, whatever the deadlines.
_MIN_SILENT_BEATS = 5
_REAPED_S = 10.0  # the longest a kill waits for the killed worker to be reaped

log = logging.getLogger("dcp_safe.manager")

# A save's name, the span events its worker recorded (dcp_safe.telemetry.Event) and, for a
# save that succeeded with ``replicate_to``, the future of its replication by the worker.
Adopt = Callable[[str, list[Any], "Future[Any] | None"], None]


class _Process:
    """One started worker: its process, its end of the socket, and the saves it holds."""

    def __init__(self, owner: SaveWorker, group: WorkerGroup | None) -> None:
        self.owner, self.lock = owner, owner._lock  # guards saves, replications, checks, dead
        self.group = group
        self.retired = False
        self.dead = False
        # Silent past the manager's deadline (with several ranks the workers' group's, that of
        # any exchange with a peer), or its bound of waits: stopped, frozen or stuck.
        bound = owner.timeout_s if group is None else min(owner.timeout_s, group.timeout_s)
        self.silent_s = max(bound, _MIN_SILENT_BEATS * BEAT_S)
        self.silenced = False  # killed for its silence
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Isolated (-I: no current directory on sys.path), its parent's pid first; it imports
        # what the parent can (a writer subclass of a test, say): sys.path's absolute entries.
        paths = [p for p in sys.path if os.path.isabs(p)]
        command = [sys.executable, "-I", _BOOT, str(os.getpid()), str(theirs.fileno()), *paths]
        with theirs:  # the worker's end: this process closes its copy once it is started
            self.popen = _spawn(command, theirs.fileno())
        self.conn = Connection(ours.detach())
        # A worker killed as it appeared breaks the pipe: its reader sees the end and it counts
        # as died (the next request starts another); never an OSError on the training thread.
        with contextlib.suppress(OSError):
            self.conn.send(("writer", owner.writer, owner.per_rank, group, owner.deep))
        self.mapped: set[int] = set()
        # seq -> (the save's future, its name, the staged state it must keep alive)
        self.saves: dict[int, tuple[Future[None], str, Any]] = {}
        self.replicating: set[str] = set()  # the names this worker replicates
        # Set once the worker imported and joined its group (or died): it can save now, unless
        # it holds why it could not join its group.
        self.ready: Future[BaseException | None] = Future()
        self.closed: Future[BaseException | None] = Future()
        self.send_lock = threading.Lock()  # one message (and its descriptor) at a time
        self.reader = threading.Thread(
            target=self._read, name="dcp_safe-worker-reader", daemon=True
        )

    @property
    def alive(self) -> bool:
        return not self.dead and not _exited(self.popen)

    def _read(self) -> None:
        try:
            while True:
                try:
                    if not self.conn.poll(self.silent_s):
                        self.silenced = True
                        self.popen.kill()  # SIGKILL ends a stopped process too
                        return
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return
                self._handle(message)
        finally:  # a worker that is gone, or a reply this side cannot read: fail what is held
            self.died()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "done":
            with self.lock:
                future, name, _ = self.saves.pop(message[1])  # the staged state is let go here
                replicated = self.owner._replications.get(name)  # None: no replicate_to
            if message[3]:  # before the save fails: whoever sees it sees the group marked too
                self.owner._broke(self)
            self._checked(name, message[5])
            if self.owner.adopt is not None:  # before the follow-up ends the root span
                try:
                    self.owner.adopt(name, message[4], replicated if message[2] is None else None)
                except Exception:  # telemetry is bookkeeping: it never fails a save
                    log.exception("dcp_safe: recording the worker's spans of %s failed", name)
            if message[2] is None:
                future.set_result(None)
                return
            error = decode_error(message[2])
            if replicated is not None and not replicated.done():
                replicated.set_exception(error)  # nothing to replicate: done, purged later
            future.set_exception(error)
        elif kind == "replicated":
            self._checked(message[1], message[3])
            with self.lock:
                replicated = self.owner._replications.setdefault(message[1], Future())
            if message[2] is None:
                replicated.set_result(message[4])  # the replica's header, as bytes for its span
            else:
                replicated.set_exception(decode_error(message[2]))
        elif kind == "closed":
            self.closed.set_result(None if message[1] is None else decode_error(message[1]))
        elif kind == "ready":
            self.ready.set_result(None if message[1] is None else decode_error(message[1]))

    def _checked(self, name: str, checked: Checked | None) -> None:  # before the save resolves
        if checked is not None:
            checked.remember()
            with self.lock:
                self.owner._checks[name] = checked

    def died(self) -> None:
        if not self.retired:  # before it is reaped and its saves fail: who sees either sees this
            self.owner._broke(self)
        code = self.popen.wait()
        with self.lock:
            self.dead = True
            held = [(f, f"the save of {n}") for _, (f, n, _) in sorted(self.saves.items())]
            self.saves.clear()
            for name in sorted(self.replicating):
                if (replicated := self.owner._replications.get(name)) is not None:
                    held.append((replicated, f"the replication of {name}"))
        for future, what in held:
            with contextlib.suppress(Exception):  # InvalidStateError: resolved meanwhile
                future.set_exception(self.death(f"during {what}", code))
        for outcome in (self.closed, self.ready):  # nobody waits for a dead worker
            if not outcome.done():
                outcome.set_result(None)

    def death(self, when: str, code: int) -> WorkerDiedError:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        if self.silenced:
            how = f"sent nothing for {self.silent_s:g} s (stopped, frozen or stuck) and was killed"
        rank = {} if self.group is None else {self.group.rank: f"its checkpoint worker {how}"}
        return WorkerDiedError(
            f"the checkpoint worker (pid {self.popen.pid}) {how} {when}; that save is failed and"
            " was not counted (the previous checkpoint is untouched). The next save starts a new"
            " worker; if it dies again look for the OOM killer, or use executor='thread'",
            rank,
        )


def _spawn(command: list[str], fd: int) -> subprocess.Popen[bytes]:
    """Start the worker from a thread that lives until it exits: its PR_SET_PDEATHSIG
    (:mod:`~dcp_safe.worker.boot`) fires when the *thread* that started it ends, not
    only its process, so no caller's short-lived thread may start it."""
    started: Future[subprocess.Popen[bytes]] = Future()

    def keep() -> None:
        try:
            popen = subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(popen)
        popen.wait()

    threading.Thread(target=keep, name="dcp_safe-worker-keeper", daemon=True).start()
    return started.result()


class SaveWorker:
    """Runs saves of staged state (in the stager's shared ``slabs``) in a worker process, which
    is sent ``writer`` pickled once. ``timeout_s``: the longest :meth:`close` waits by default;
    ``groups``: with several ranks, the workers' groups; ``adopt``: given each save's span events
    before its future resolves (``None``: the worker records none); ``deep``: the worker checks
    every byte of each new checkpoint (:func:`~dcp_safe.worker.transport.check_commit`).
    """

    def __init__(
        self,
        writer: SafeStorageWriter,
        slabs: SharedSlabs,
        per_rank: tuple[str, ...],
        timeout_s: float,
        groups: WorkerGroups | None,
        adopt: Adopt | None,
        deep: bool,
    ) -> None:
        self.writer, self.per_rank, self.timeout_s, self.adopt = writer, per_rank, timeout_s, adopt
        self.deep, self._groups = deep, groups
        self._checks: dict[str, Checked] = {}
        self._encoder = StateEncoder(slabs)
        self._lock = threading.Lock()
        self._process: _Process | None = None
        self._retired: list[_Process] = []  # of earlier generations, closing
        self._broken_at: int | None = None  # the generation this rank saw break
        self._replications: dict[str, Future[Any]] = {}
        self._seq = 0
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-worker")

    @property
    def pid(self) -> int | None:  # None before the first save or after a death
        process = self._process
        return None if process is None or _exited(process.popen) else process.popen.pid

    @property
    def ready(self) -> bool:  # it imported and joined the ranks' current group: it can save now
        process, groups = self._process, self._groups
        return (
            process is not None
            and (groups is None or process.group == groups.current())
            and process.ready.done()
            and process.ready.result() is None
            and process.alive
        )

    def start(self) -> None:
        """Start a worker if none runs in the current group, without waiting for it; one that
        cannot start yet (its group broke, to be replaced at the next vote) starts later."""
        with self._lock:
            try:
                process = self._started()
            except CommitError:
                return
            except OSError as exc:  # no process to start (fork, memory): saves stay on threads
                log.warning("dcp_safe: the checkpoint worker could not start: %s", exc)
                return
        if process.ready.done() and process.ready.result() is not None:
            self._broke(process)  # it will never save: the ranks replace it

    def submit(
        self,
        name: str,
        step: int,
        staged: Future[dict[str, Any]],
        metrics: Mapping[str, float | str] | None = None,
    ) -> Future[None]:
        """Save the state ``staged`` resolves to as ``name`` (its manifest records ``metrics``);
        a future of the save's end (failing with the staging's error, the save's, or
        :class:`WorkerDiedError`)."""
        done: Future[None] = Future()
        self._sender.submit(self._send, name, (step, metrics), staged, done)
        return done

    def replication(self, name: str) -> Future[Any]:
        with self._lock:
            replicated = self._replications.get(name)
        # No worker replicates it (it was saved before this manager): watch the remote marker.
        return self.writer.replication(name) if replicated is None else replicated

    def checked(self, name: str) -> Checked | None:  # once; None: the caller checks
        with self._lock:
            return self._checks.pop(name, None)

    def close(self, timeout_s: float | None) -> None:
        """Stop the worker within ``timeout_s`` (default: the one given at construction); past
        it the worker is killed, whatever it is doing (stopped, stuck in a save, draining).

        Raises:
            BaseException: the worker's writer failed to drain its replication.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        # The saves queued are sent first, by the deadline: a send blocked on a stopped worker
        # is freed by that worker's kill below, and one sent then to a new worker is stopped too.
        with contextlib.suppress(RuntimeError):  # closed before
            wait([self._sender.submit(lambda: None)], max(0.0, deadline - time.monotonic()))
        self._sender.shutdown(wait=False)
        errors = self._stop_all(timeout_s, deadline)
        self._sender.shutdown(wait=True)
        errors += self._stop_all(timeout_s, deadline)
        error = next((e for e in reversed(errors) if e is not None), None)
        if error is not None:
            raise error

    def kill(self) -> None:
        """Kill every worker now, without waiting (a close that ran out of time: no worker
        outlives its manager); their saves fail with :class:`WorkerDiedError`."""
        processes = self._retire_all()
        for each in processes:
            with contextlib.suppress(OSError):
                each.popen.kill()
        for each in processes:  # reaped: gone once this returns (unless stuck in the kernel)
            with contextlib.suppress(subprocess.TimeoutExpired):
                each.popen.wait(_REAPED_S)

    def _retire_all(self) -> list[_Process]:
        with self._lock:  # retired until stopped: a kill meanwhile finds them there
            process, self._process = self._process, None
            self._retired += [] if process is None else [process]
            for each in self._retired:
                each.retired = True  # stopped on purpose: no group to mark broken
            return list(self._retired)

    def _stop_all(self, timeout_s: float, deadline: float) -> list[BaseException | None]:
        processes = self._retire_all()
        errors = [_stop(each, timeout_s, deadline) for each in processes]
        with self._lock:
            self._retired = [each for each in self._retired if each not in processes]
        return errors

    def _send(
        self,
        name: str,
        step: tuple[int, Mapping[str, float | str] | None],
        staged: Future[dict[str, Any]],
        done: Future[None],
    ) -> None:
        try:
            state = staged.result()
            data = self._encoder.dump(state)
            record = self.adopt is not None
            for retry in (False, True):
                process, seq = self._register(name, done, state)
                try:  # outside the lock: a worker dying meanwhile fails it through its reader
                    with process.send_lock:
                        self._share_slabs(process)
                        # The rank's file size limit now (set or lifted since the worker began).
                        fsize = resource.getrlimit(resource.RLIMIT_FSIZE)
                        process.conn.send(("save", seq, name, step, data, record, fsize))
                    return
                except OSError:
                    with self._lock:  # it died idle, before this save: one new worker more
                        process.dead = True
                        if retry or process.saves.pop(seq, None) is None:
                            return  # its reader fails the save
        except BaseException as exc:
            with contextlib.suppress(Exception):  # InvalidStateError: failed by a death
                done.set_exception(exc)

    def _register(self, name: str, done: Future[None], state: Any) -> tuple[_Process, int]:
        # In the live worker's book, which keeps the state alive.
        with self._lock:
            process = self._started()
            self._seq += 1
            process.saves[self._seq] = (done, name, state)
            if self.writer.remote is not None:
                for finished in [n for n, f in self._replications.items() if f.done()]:
                    del self._replications[finished]
                self._replications[name] = Future()
                process.replicating.add(name)
            return process, self._seq

    def _started(self) -> _Process:
        """The live worker, started anew if there is none (call with the lock held).

        Raises:
            CommitError: with several ranks, the workers' group broke and the ranks have not
                replaced it yet (:class:`WorkerDiedError` where this rank's worker died).
        """
        process, groups = self._process, self._groups
        group = None if groups is None else groups.current()
        alive = process is not None and process.alive
        if groups is not None and group is not None:
            if process is not None and not alive and process.group == group:
                self._broken_at = group.generation  # its reader says so too, any moment now
                groups.broke()
            if self._broken_at == group.generation:
                raise _not_replaced_yet(group, died=not alive)
            if alive and process is not None and process.group != group:
                # The ranks replaced the group: every one starts anew. This one drains its
                # replication without being waited for here (close() waits for it).
                process.retired, alive = True, False
                self._retired.append(process)
                with contextlib.suppress(OSError), process.send_lock:
                    process.conn.send(("close", self.timeout_s))
        if not alive:
            # A dead one's reader fails the saves it held, on its own thread.
            process = self._process = _Process(self, group)
            process.reader.start()
        assert process is not None
        return process

    def _broke(self, process: _Process) -> None:  # the ranks replace the group at their next vote
        if self._groups is None or process.group is None:
            return
        generation = process.group.generation
        if generation != self._groups.current().generation:
            return  # a group the ranks replaced already (a vote while its save was failing)
        with self._lock:
            self._broken_at = generation
        self._groups.broke()

    def _share_slabs(self, process: _Process) -> None:
        open_slabs = self._encoder.slabs.slabs()
        try:
            if gone := process.mapped - set(open_slabs):
                process.conn.send(("forget", sorted(gone)))
            for slab, (fd, size) in open_slabs.items():
                if slab not in process.mapped:
                    process.conn.send(("slab", slab, size))
                    send_handle(process.conn, fd, process.popen.pid)
            process.mapped = set(open_slabs)
        finally:
            for fd, _ in open_slabs.values():
                os.close(fd)


def _stop(process: _Process, timeout_s: float, deadline: float) -> BaseException | None:
    # Closed by ``deadline`` (killed past it); its writer's error, if any.
    with process.lock:
        starting = not process.ready.done() and not process.saves
    if starting:  # it holds nothing to drain: waiting for its imports would only delay close
        process.popen.kill()
    # A send blocked on a stopped worker holds the lock: it is killed at the deadline instead.
    if process.send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        try:
            with contextlib.suppress(OSError):
                process.conn.send(("close", timeout_s))
        finally:
            process.send_lock.release()
    error = None
    with contextlib.suppress(TimeoutError):
        error = process.closed.result(max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.popen.wait(max(0.0, deadline - time.monotonic()))
    if process.popen.poll() is None:
        process.popen.kill()
    process.reader.join()
    process.conn.close()
    return error


def _exited(popen: subprocess.Popen[bytes]) -> bool:
    """``popen``'s process has ended, whether or not a thread has reaped it yet.

    Not :meth:`~subprocess.Popen.poll`: that answers "running" while another thread waits on
    the process (the keeper does, all its life), until that thread is next scheduled; a save
    admitted meanwhile would go to a dead worker. ``WNOWAIT`` leaves the reaping to the keeper.
    """
    if popen.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already (by the keeper, or by whoever waited on it)
        return True


def _not_replaced_yet(group: WorkerGroup, *, died: bool) -> CommitError:
    what = "this rank's checkpoint worker died" if died else "the checkpoint workers' group broke"
    message = (
        f"{what} in an earlier save, and the ranks have not replaced their workers yet: this"
        " save was not started and nothing was published (the previous checkpoint is intact)."
        " The ranks start new workers together at their next save"
    )
    if died:
        return WorkerDiedError(message, {group.rank: "its checkpoint worker died"})
    return CommitError(message)
