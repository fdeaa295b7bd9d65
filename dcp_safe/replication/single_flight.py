"""``SingleFlight``: one background job at a time per owner, the newest pending one kept.

The engine under the replicators (``Replicator``, ``RankReplicator``). One daemon worker
thread, started by :meth:`submit`, exits whenever nothing is pending.

Coalescing: while one job runs, at most one more is pending; a newer name replaces it, and its
future fails with :class:`~dcp_safe.errors.ReplicationSkippedError`.

Errors: a failed job's original exception is in its future. :meth:`close` re-raises the first
failure whose future nobody retrieved (``result()`` or ``exception()``, in a done-callback too),
so a fire-and-forget owner cannot lose it; only that one is held. Skips are policy: ``close``
does not raise them.

Not picklable (a lock and a thread): an owner drops it in ``__getstate__``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import TracebackType
from typing import NoReturn

from dcp_safe import layout
from dcp_safe.errors import ConfigError, ReplicationSkippedError, ReplicationTimeoutError
from dcp_safe.manifest.schema import Manifest

__all__ = ["DEFAULT_KEEP_DONE", "SingleFlight"]

# Finished futures kept for ``SingleFlight.future``; pending and running ones are always kept.
DEFAULT_KEEP_DONE = 16


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


class SingleFlight:
    """Named background jobs, one at a time (see the module docstring).

    Args:
        what: what the jobs do and where, for messages (``"replication to s3://b/ckpt"``).
        keep_done: how many finished futures :meth:`future` can still return.

    Attributes:
        skipped: names whose job was skipped for a newer one, oldest first.
    """

    def __init__(
        self, what: str, *, keep_done: int = DEFAULT_KEEP_DONE, thread_name: str = "dcp_safe-work"
    ) -> None:
        if keep_done < 0:
            raise ConfigError(f"keep_done must not be negative, got {keep_done}")
        self.what, self.thread_name = what, thread_name
        self.keep_done = keep_done
        self.skipped: list[str] = []
        self._cond = threading.Condition()
        self._futures: dict[str, _TrackedFuture] = {}
        self._unseen: _TrackedFuture | None = None  # the first failure nobody retrieved
        self._pending: str | None = None
        self._running: str | None = None
        self._thread: threading.Thread | None = None
        self._last_thread: threading.Thread | None = None
        self._closed = False

    def submit(self, name: str) -> Future[Manifest]:
        """Schedule this worker's job for ``name`` (:meth:`_run_job`).

        Returns:
            Its future: the job's manifest, or its error. A name already pending or running
            gets its existing future back.

        Raises:
            InvalidCheckpointNameError: ``name`` is not a valid checkpoint name.
            ConfigError: the worker is closed.
        """
        name = layout.validate_name(name)
        superseded = None
        with self._cond:
            if self._closed:
                raise ConfigError(f"the {self.what} is closed; it takes no new work")
            existing = self._futures.get(name)
            if existing is not None and not existing.done():
                return existing
            future = _TrackedFuture()
            if self._pending is not None and self._pending != name:  # equal: it was cancelled
                superseded = self._pending
                self._skip(superseded, superseded_by=name)
            self._pending = name
            self._futures.pop(name, None)
            self._futures[name] = future
            self._forget_old()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name=self.thread_name, daemon=True
                )
                self._last_thread = self._thread
                self._thread.start()
        if superseded is not None:
            self._skipped(superseded, superseded_by=name)
        return future

    def future(self, name: str) -> Future[Manifest]:
        """The future of the latest submission of ``name``.

        Raises:
            KeyError: ``name`` was never submitted (or finished long enough ago to be
                forgotten: only the newest ``keep_done`` finished futures are kept).
        """
        with self._cond:
            return self._futures[name]

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until nothing is pending or running. Errors stay in their futures.

        Raises:
            ReplicationTimeoutError: still busy after ``timeout_s`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(self._drained, timeout_s):
                busy = ", ".join(n for n in (self._running, self._pending) if n)
                raise ReplicationTimeoutError(
                    f"{self.what} still busy after {timeout_s} s ({busy})"
                )

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work, drain what was submitted, and let the worker thread exit.

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

    def __enter__(self) -> SingleFlight:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"a {type(self).__name__} owns a thread and a lock and cannot be pickled; drop it"
            " in the owner's __getstate__"
        )

    # ----------------------------------------------------------------- worker

    def _run_job(self, name: str) -> Manifest:
        """The job for ``name`` (a subclass's replication of it)."""
        raise NotImplementedError

    def _skipped(self, name: str, *, superseded_by: str) -> None:
        """Called by :meth:`submit`, without the lock, after it skipped pending ``name``."""

    def _work(self) -> None:
        while True:
            with self._cond:
                name = self._pending
                if name is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._pending, self._running = None, name
                future = self._futures.get(name)  # absent only if cancelled and forgotten
            if future is not None and future.set_running_or_notify_cancel():
                self._run(future, name)
            with self._cond:
                self._running = None
                self._forget_old()
                self._cond.notify_all()

    def _run(self, future: _TrackedFuture, name: str) -> None:
        try:
            manifest = self._run_job(name)
        except BaseException as exc:  # the owner decides what is fatal; it reaches the future
            with self._cond:
                if self._unseen is None or self._unseen.retrieved:
                    self._unseen = future
            future.set_exception(exc)
        else:
            future.set_result(manifest)

    def _skip(self, name: str, *, superseded_by: str) -> None:
        """Fail pending ``name``'s future (unless the owner cancelled it). Holds the lock."""
        self.skipped.append(name)
        future = self._futures.get(name)
        if future is not None and future.set_running_or_notify_cancel():
            future.set_exception(ReplicationSkippedError(name, superseded_by))

    def _forget_old(self) -> None:
        """Drop the oldest finished futures beyond ``keep_done``. Holds the lock."""
        done = [n for n, f in self._futures.items() if f.done()]
        for name in done[: max(0, len(done) - self.keep_done)]:
            del self._futures[name]

    def _drained(self) -> bool:
        return self._pending is None and self._running is None and self._thread is None
