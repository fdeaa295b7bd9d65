"""Replication: copy a committed local checkpoint to the remote tier and commit it there.

:func:`replicate_checkpoint` does one checkpoint (the verified copy is
:mod:`dcp_safe.replication.copying`'s, the publish :mod:`dcp_safe.commit.replica`'s;
a save of several ranks uses them per rank: :mod:`dcp_safe.replication.rank_replicator`).
:class:`Replicator` runs them on one background thread, coalescing to the newest name. The
protocol, and why it copies committed files rather than staging buffers: docs/architecture.md,
"Replication and the remote tier".

Errors raised here, beyond the ones backends raise::

    DcpSafeError
    ├── ReplicationSkippedError              a pending replication superseded by a newer one
    └── ReplicationTimeoutError(TimeoutError)   wait()/close() could not drain in time

A local file that does not match its manifest is :class:`~dcp_safe.errors.CheckpointCorruptError`;
a remote object missing or of the wrong size after upload is
:class:`~dcp_safe.errors.StorageError` (the remote tier misbehaved, the source is fine).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import TracebackType
from typing import NoReturn

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.replica import committed_with
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.commit.takeover import Claimant
from dcp_safe.errors import (
    ConfigError,
    ReplicationSkippedError,
    ReplicationTimeoutError,
)
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.replication.copying import (
    DEFAULT_CHUNK_BYTES,
    CheckpointCopy,
    copy_buffer_bytes,
    copy_file_verified,
    open_source,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ReplicationSkippedError",
    "ReplicationTimeoutError",
    "Replicator",
    "copy_file_verified",
    "replicate_checkpoint",
]

# Finished futures kept for ``Replicator.future``; pending and running ones are always kept.
_DEFAULT_KEEP_DONE = 16


# --------------------------------------------------------------------- one checkpoint


def replicate_checkpoint(
    local: Backend,
    remote: Backend,
    name: str,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    claimant: Claimant | None = None,
) -> Manifest:
    """Copy committed checkpoint ``name`` from ``local`` to ``remote`` and commit it there.

    Idempotent: when ``remote`` already holds ``name`` committed with the same manifest digest,
    nothing is copied. The remote marker is trusted as every reader trusts it; run
    ``verify_checkpoint`` on the remote root for a full byte check.

    Args:
        local: the root holding the committed checkpoint.
        remote: the root to copy it to.
        name: the checkpoint's name under both roots.
        chunk_bytes: bytes read and handed to the remote file at a time (files are copied one
            at a time; see :func:`~dcp_safe.replication.copying.copy_buffer_bytes` for the
            memory a copy holds).
        claimant: this process's job attempt, as the remote lease records it; a lease of
            another save id that it may take over is taken over (:mod:`dcp_safe.commit.takeover`).

    Returns:
        The checkpoint's manifest.

    Raises:
        CheckpointNotFoundError: ``name`` is not committed locally.
        CheckpointCorruptError: a local file does not match the manifest; nothing is committed.
        CheckpointExistsError: ``remote`` holds ``name`` committed with another manifest, or
            (object stores) another save holds its writing lease; nothing is uploaded.
        StaleWriterError: (object stores) the lease was lost while uploading, and ``name`` is
            not committed with this manifest; nothing is committed.
        StorageError: a remote (or local) I/O step failed, or an uploaded object is missing or
            of the wrong size; nothing is committed.
    """
    name = layout.validate_name(name)
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
    manifest, raw = open_source(local, name)
    digest = manifest_digest(raw)
    if committed_with(remote, name, digest):
        return manifest
    strategy = strategy_for(remote)
    work_dir = strategy.work_dir(name, layout.new_save_id())
    replica = strategy.replica(remote, manifest, digest, work_dir, claimant or Claimant())
    if not replica.claim():
        return manifest  # the same checkpoint got committed meanwhile
    copy = CheckpointCopy(
        local, remote, name, manifest, raw, chunk_bytes, before_each=replica.check
    )
    replica.publish(lambda: copy.upload_to(work_dir), copy.uploaded)
    return manifest


# --------------------------------------------------------------------- background


class _ReplicationFuture(Future[Manifest]):
    """A future that remembers whether anyone looked at its outcome (see ``Replicator.close``)."""

    retrieved = False

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self.retrieved = True
        return error

    def result(self, timeout: float | None = None) -> Manifest:
        self.exception(timeout)
        return super().result(0)


class Replicator:
    """Replicates newly committed checkpoints from ``local`` to ``remote``, in the background.

    Call order: the owner (the writer, after a local commit) calls :meth:`submit` with each
    committed name, from any thread; results arrive through the returned futures; the owner
    calls :meth:`close` once at the end. One daemon worker thread runs replications one at a
    time; it is started by ``submit`` and exits whenever nothing is pending, so an idle or
    forgotten replicator holds no thread.

    Coalescing: while one replication runs, at most one more is pending. Submitting a newer
    name replaces the pending one, whose future fails with :class:`ReplicationSkippedError`
    naming its successor; the skipped names are recorded in :attr:`skipped`.

    Errors: a failed replication's original exception is in its future. :meth:`close`
    re-raises the first failure whose future nobody retrieved (``result()`` or
    ``exception()``, a done-callback's included), so a fire-and-forget owner cannot lose it,
    while an owner that checked its futures is not told twice. Only one such failure is held
    (a later one takes the slot once the held one is retrieved), so a long run of failures
    keeps no tracebacks alive. Skips are policy, not failures: ``close`` does not raise them.

    Not picklable (it owns a lock and a thread): an owner pickled into DCP's process executor
    must drop it in ``__getstate__``.

    Args:
        local: the root checkpoints are committed to first.
        remote: the root to replicate them to.
        chunk_bytes: passed to :func:`replicate_checkpoint`.
        keep_done: how many finished futures :meth:`future` can still return.
        claimant: the owner's job attempt, as remote leases record it (see
            :func:`replicate_checkpoint`).

    Attributes:
        skipped: names whose replication was skipped for a newer one, oldest first.
    """

    def __init__(
        self,
        local: Backend,
        remote: Backend,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_done: int = _DEFAULT_KEEP_DONE,
        claimant: Claimant | None = None,
    ) -> None:
        if chunk_bytes < 1 or keep_done < 0:
            raise ConfigError("chunk_bytes must be positive and keep_done not negative")
        self.local = local
        self.remote = remote
        self.chunk_bytes = chunk_bytes
        self.keep_done = keep_done
        self.claimant = claimant
        self.skipped: list[str] = []
        self._cond = threading.Condition()
        self._futures: dict[str, _ReplicationFuture] = {}
        self._unseen: _ReplicationFuture | None = None  # the first failure nobody retrieved
        self._pending: str | None = None
        self._running: str | None = None
        self._thread: threading.Thread | None = None
        self._last_thread: threading.Thread | None = None
        self._closed = False

    def submit(self, name: str) -> Future[Manifest]:
        """Schedule replication of committed checkpoint ``name``.

        Returns:
            Its future: the manifest once committed remotely, or the error. A name already
            pending or running gets its existing future back.

        Raises:
            InvalidCheckpointNameError: ``name`` is not a valid checkpoint name.
            ConfigError: the replicator is closed.
        """
        name = layout.validate_name(name)
        superseded = None
        with self._cond:
            if self._closed:
                raise ConfigError("this Replicator is closed; it takes no new checkpoints")
            existing = self._futures.get(name)
            if existing is not None and not existing.done():
                return existing
            future = _ReplicationFuture()
            if self._pending is not None and self._pending != name:  # equal: it was cancelled
                superseded = self._pending
                self._skip(superseded, superseded_by=name)
            self._pending = name
            self._futures.pop(name, None)
            self._futures[name] = future
            self._forget_old()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="dcp_safe-replicator", daemon=True
                )
                self._last_thread = self._thread
                self._thread.start()
        if superseded is not None:
            self._skipped(superseded, superseded_by=name)
        return future

    @property
    def max_buffer_bytes(self) -> int | None:
        """The most host bytes a replication holds at once (one file is copied at a time): the
        chunk read plus the remote upload's part buffers. An owner with a memory budget counts
        it as another consumer of the envelope, as it stays held while the next save stages.
        None where the remote's buffering is not known (an fsspec object store other than S3).
        """
        return copy_buffer_bytes(self.remote, self.chunk_bytes)

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
                    f"replication to {self.remote.url} still busy after {timeout_s} s ({busy})"
                )

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work, drain what was submitted, and let the worker thread exit.

        Calling it again (say, after a timeout) waits again; it is cheap once drained.

        Raises:
            ReplicationTimeoutError: not drained within ``timeout_s`` seconds; the work goes on
                in the background.
            BaseException: the first replication failure whose future was never retrieved,
                as it was raised (it counts as retrieved afterwards).
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

    def __enter__(self) -> Replicator:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "a Replicator owns a thread and a lock and cannot be pickled; drop it in the "
            "owner's __getstate__"
        )

    # ----------------------------------------------------------------- worker

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
                self._run(name, future)
            with self._cond:
                self._running = None
                self._forget_old()
                self._cond.notify_all()

    def _replicate(self, name: str) -> Manifest:
        """One replication, on the worker thread (a subclass may do it its own way)."""
        return replicate_checkpoint(
            self.local, self.remote, name, chunk_bytes=self.chunk_bytes, claimant=self.claimant
        )

    def _skipped(self, name: str, *, superseded_by: str) -> None:
        """Called by :meth:`submit`, without the lock, after it skipped pending ``name``."""

    def _run(self, name: str, future: _ReplicationFuture) -> None:
        try:
            manifest = self._replicate(name)
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
