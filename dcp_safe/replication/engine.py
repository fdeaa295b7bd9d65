"""``UploadEngine``: every upload's engine, and the one place upload threads start.

Named jobs, each with a future: :meth:`~UploadEngine.submit` runs them one at a time on a lane
(a newer pending name replaces the pending one, whose future fails with
:class:`~dcp_safe.errors.ReplicationSkippedError`); a lane job may return its commit wait instead
of its manifest, and :meth:`~UploadEngine.start` runs a job, like such a wait, on a thread of its
own, so a commit wait never queues (docs/architecture.md, "The upload engine"). A failed job's
exception is in its future; ``close`` re-raises the first one nobody retrieved. Not picklable:
an owner drops it in ``__getstate__``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import NoReturn, TypeAlias

from dcp_safe import layout
from dcp_safe.errors import ConfigError, ReplicationSkippedError, ReplicationTimeoutError
from dcp_safe.manifest.schema import Manifest

#: A job: its manifest, or the commit wait still to run for it (on a thread of its own).
Job: TypeAlias = Callable[[], "Manifest | Job"]


class _TrackedFuture(Future[Manifest]):
    """A future that remembers whether anyone looked at its outcome (see ``close``)."""

    retrieved = False

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self.retrieved = True
        return error

    def result(self, timeout: float | None = None) -> Manifest:
        self.exception(timeout)
        return super().result(0)


class UploadEngine:
    """Named background jobs (the module docstring); ``what`` they do and where, for messages
    (``"replication to s3://b/ckpt"``); ``skipped``: names skipped for a newer one, oldest first.
    """

    keep_done = 16  # finished futures :meth:`future` can still return

    def __init__(self, what: str, *, thread_name: str = "dcp_safe-work") -> None:
        self.what, self.thread_name = what, thread_name
        self.skipped: list[str] = []
        self._cond = threading.Condition()
        self._futures: dict[str, _TrackedFuture] = {}
        self._unseen: _TrackedFuture | None = None  # the first failure nobody retrieved
        self._pending: str | None = None
        self._thread: threading.Thread | None = None  # the lane's worker
        self._last_thread: threading.Thread | None = None
        self._threads: dict[threading.Thread, str] = {}  # every live thread, with its job's name
        self._closed = False

    def submit(self, name: str) -> Future[Manifest]:
        """Schedule the lane's job for ``name`` (:meth:`_run_job`): its future (a name already
        pending or running gets its existing one back).

        Raises:
            InvalidCheckpointNameError: ``name`` is not a valid checkpoint name.
            ConfigError: the engine is closed.
        """
        name, superseded = layout.validate_name(name), None
        with self._cond:
            existing = self._futures.get(name)
            if existing is not None and not existing.done() and not self._closed:
                return existing
            future = self._new_future(name)
            if self._pending is not None and self._pending != name:  # equal: it was cancelled
                superseded = self._pending
                self.skipped.append(superseded)
                old = self._futures.get(superseded)  # failed, unless the owner cancelled it
                if old is not None and old.set_running_or_notify_cancel():
                    old.set_exception(ReplicationSkippedError(superseded, name))
            self._pending = name
            if self._thread is None:
                self._thread = self._last_thread = self._spawn(self._work, "")
        if superseded is not None:
            self._skipped(superseded, superseded_by=name)
        return future

    def start(self, name: str, job: Job) -> Future[Manifest]:
        """Run ``job`` now on a thread of its own; its future becomes ``name``'s (raises as
        :meth:`submit` does)."""
        with self._cond:
            future = self._new_future(name)
            future.set_running_or_notify_cancel()
            self._spawn(functools.partial(self._settle, future, name, job), name)
        return future

    def future(self, name: str) -> Future[Manifest]:
        """The future of the latest job of ``name``; KeyError if it was never submitted, or
        finished long enough ago to be forgotten (only ``keep_done`` finished ones are kept)."""
        with self._cond:
            return self._futures[name]

    def futures(self) -> list[Future[Manifest]]:
        with self._cond:
            return list(self._futures.values())

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until no job is pending or running. Errors stay in their futures.

        Raises:
            ReplicationTimeoutError: still busy after ``timeout_s`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._threads, timeout_s):
                names = {n for n in [self._pending, *self._threads.values()] if n}
                busy = f"{self.what} still busy after {timeout_s} s"
                raise ReplicationTimeoutError(f"{busy} ({', '.join(sorted(names))})")

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work, drain what was submitted, and let the threads exit.

        Calling it again (say, after a timeout) waits again; it is cheap once drained.

        Raises:
            ReplicationTimeoutError: not drained within ``timeout_s`` seconds; the work goes on
                in the background.
            BaseException: the first failure whose future was never retrieved, as it was
                raised (it counts as retrieved afterwards).
        """
        with self._cond:
            self._closed = True
        self.wait(timeout_s)
        with self._cond:
            worker, unseen, self._unseen = self._last_thread, self._unseen, None
        if worker is not None:
            worker.join()  # it has left its loop: this returns at once
        if unseen is not None and not unseen.retrieved:
            unseen.result()  # raises the original exception and marks it retrieved

    def __enter__(self) -> UploadEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"a {type(self).__name__} owns threads and a lock and cannot be pickled; drop it"
            " in the owner's __getstate__"
        )

    def _run_job(self, name: str) -> Manifest | Job:
        """The lane's job for ``name`` (a subclass's replication of it)."""
        raise NotImplementedError

    def _skipped(self, name: str, *, superseded_by: str) -> None:
        """Called by :meth:`submit`, without the lock, after it skipped pending ``name``."""

    def _new_future(self, name: str) -> _TrackedFuture:
        """A fresh future for ``name``, replacing its old one. Holds the lock."""
        name = layout.validate_name(name)
        if self._closed:
            raise ConfigError(f"the {self.what} is closed; it takes no new work")
        future = _TrackedFuture()
        self._futures.pop(name, None)
        self._futures[name] = future
        self._forget_old()
        return future

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a daemon thread that leaves :attr:`_threads` when ``target`` returns. Holds
        the lock (the thread's exit takes it, so it never misses its own entry)."""

        def run() -> None:
            try:
                target()
            finally:
                with self._cond:
                    del self._threads[thread]
                    self._forget_old()
                    self._cond.notify_all()

        suffix = f"-{name}" if name else ""
        thread = threading.Thread(target=run, name=self.thread_name + suffix, daemon=True)
        self._threads[thread] = name
        thread.start()
        return thread

    def _work(self) -> None:
        while True:
            with self._cond:
                name = self._pending
                if name is None:
                    self._thread = None
                    return
                self._pending = None
                self._threads[threading.current_thread()] = name
                future = self._futures.get(name)  # absent only if cancelled and forgotten
            if future is not None and future.set_running_or_notify_cancel():
                self._settle(future, name, functools.partial(self._run_job, name))
            with self._cond:
                self._threads[threading.current_thread()] = ""
                self._forget_old()

    def _settle(self, future: _TrackedFuture, name: str, job: Job) -> None:
        """Run ``job`` into ``future``; a commit wait it returns goes to a thread of its own."""
        try:
            outcome = job()
        except BaseException as exc:  # the owner decides what is fatal; it reaches the future
            with self._cond:
                if self._unseen is None or self._unseen.retrieved:
                    self._unseen = future
            future.set_exception(exc)
            return
        if isinstance(outcome, Manifest):
            future.set_result(outcome)
        else:
            with self._cond:
                self._spawn(functools.partial(self._settle, future, name, outcome), name)

    def _forget_old(self) -> None:
        """Drop the oldest finished futures beyond ``keep_done``. Holds the lock."""
        done = [n for n, f in self._futures.items() if f.done()]
        for name in done[: max(0, len(done) - self.keep_done)]:
            del self._futures[name]
