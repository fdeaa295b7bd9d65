"""The checkpoint worker, one per rank: :func:`main`, after :mod:`~dcp_safe.worker.boot` (which
knew its parent, lowered its priority and started its beat before this module's imports).

Started by :class:`~dcp_safe.worker.parent.SaveWorker` with one end of a socket pair. It serves
the parent's messages in order until told to close or the parent is gone; from its start on it
also sends ``("alive",)`` every second (the parent kills a worker silent past its bound)::

    ("writer", writer, per_rank, group, deep): the manager's writer (pickled once), per-rank keys,
        with several ranks the workers' group to join first (WorkerGroup), and how each new
        checkpoint is checked (every byte or not); reply ("ready", None), or ("ready", error)
        where joining the group failed (every save then fails with it)
    ("slab", id, size) + a fd: map a staging slab (the fd follows as SCM_RIGHTS)
    ("forget", ids): unmap slabs the parent closed
    ("save", seq, name, (step, metrics), data, record, fsize): save the staged state ``data``
        (not if the parent is gone: the worker exits) under the rank's RLIMIT_FSIZE ``fsize``
        (one it cannot take fails the save): plan, write, checksums, manifest, commit, check;
        reply ("done", seq, error or None, whether the workers' group broke, the save's plan,
        write and commit spans when ``record``, its check or None), then, with ``replicate_to``
        or a node-local cache, ("replicated", name, error or None, its check or None, the
        replica manifest's header or None)
    ("close", timeout_s): drain the writer's replication; reply ("closed", error)

A check (:func:`~.transport.check_commit`) follows the commit here, so that the training
process parses no manifest of its saves; a node-local save is checked once its remote commit is
done, before that is reported. With ``record`` (the parent's manager has telemetry) the save's
writer is wrapped as the thread executor wraps it, and its span events go back with the reply,
for the parent to adopt under the save's root span (:meth:`~dcp_safe.telemetry.Telemetry.adopt`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch.distributed as dist

from dcp_safe.adapters import api
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.checkpoints.committed import CommittedHeader, keep_parsed
from dcp_safe.coordination.group import is_group_failure
from dcp_safe.coordination.worker_group import WorkerGroup, join
from dcp_safe.errors import WorkerError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.telemetry.memory import anchored_clock
from dcp_safe.telemetry.recorder import Telemetry
from dcp_safe.telemetry.sinks import Event
from dcp_safe.worker.transport import Checked, check_commit, encode_error, forget_slab, map_slab


class _Worker:
    def __init__(self, conn: Connection, lock: threading.Lock, parent: int) -> None:
        # Replies come from the main thread, replication's and the beat: one ``lock``.
        self.conn, self.lock, self.parent = conn, lock, parent
        self.writer: SafeStorageWriter | None = None
        self.per_rank: tuple[str, ...] = ()
        self.group: WorkerGroup | None = None
        self.deep = False  # check every byte of a new checkpoint
        self.not_joined: bytes | None = None  # why it could not join: every save fails so
        self.clock = anchored_clock()  # one anchor for every save's spans

    def reply(self, *message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            kind = message[0]
            if kind == "writer":
                _, self.writer, self.per_rank, self.group, self.deep = message
                try:
                    if self.group is not None:
                        join(self.group)
                except BaseException as exc:
                    self.not_joined = encode_error(exc)
                self.reply("ready", self.not_joined)
            elif kind == "slab":
                map_slab(message[1], recv_handle(self.conn), message[2])
            elif kind == "forget":
                for slab in message[1]:
                    forget_slab(slab)
            elif kind == "save":
                if os.getppid() != self.parent:  # sent by a rank that died since
                    os._exit(3)
                self.save(*message[1:])
            elif kind == "close":
                self.close(message[1])
                return

    def save(
        self,
        seq: int,
        name: str,
        step: tuple[int, Mapping[str, float | str] | None],
        data: bytes,
        record: bool,
        fsize: tuple[int, int],
    ) -> None:
        # Several ranks: over the workers' group, on a dedicated group of the save's deadline,
        # as the thread executor saves over the manager's.
        where: dict[str, Any] = (
            {"no_dist": True} if self.group is None else {"deadline_s": self.group.timeout_s}
        )
        if self.not_joined is not None:
            self.reply("done", seq, self.not_joined, True, [], None)
            return
        # A recorder of this save alone (no sampler, no thread): its events go with the reply.
        telemetry = Telemetry(sample_memory=False, rank=0, clock=self.clock) if record else None
        try:
            _limit_files(fsize)
            assert self.writer is not None  # the parent sends it first
            writer = self.writer.for_step(*step)
            state = pickle.loads(data)
            api.save(
                state,
                checkpoint_id=name,
                storage_writer=writer if telemetry is None else telemetry.wrap_writer(writer),
                per_rank=self.per_rank,
                **where,
            )
        except BaseException as exc:
            error = encode_error(exc)
            self.reply("done", seq, error, is_group_failure(exc), _events(telemetry), None)
            return
        finally:
            state = None  # no view of the parent's buffers outlives the save
        cached = writer.topology.node_cache is not None  # committed once uploaded
        checked = None if cached else self._check(writer, name)
        self.reply("done", seq, None, False, _events(telemetry), checked)
        if writer.remote is not None:
            writer.replication(name).add_done_callback(
                lambda f: self._replicated(writer, name, f, check=cached)
            )

    def _check(self, writer: SafeStorageWriter, name: str) -> Checked:
        try:
            digest, header = check_commit(writer, name, deep=self.deep)
        except BaseException as exc:  # the parent fails the save with it, as its own check would
            return Checked(error=encode_error(exc))
        return Checked(digest=digest, header=header)

    def _replicated(
        self, writer: SafeStorageWriter, name: str, done: Future[Any], *, check: bool
    ) -> None:
        error = done.exception()
        checked = self._check(writer, name) if check and error is None else None
        # Its header, not the whole manifest: what the span's bytes and the handle need, and
        # no per-item unpickling in the training process.
        replica = None if error is not None else done.result()
        header = CommittedHeader.of(replica) if isinstance(replica, Manifest) else None
        with contextlib.suppress(OSError):
            encoded = None if error is None else encode_error(error)
            self.reply("replicated", name, encoded, checked, header)

    def close(self, timeout_s: float | None) -> None:
        error = None
        try:
            if self.writer is not None:
                self.writer.close(timeout_s)
        except BaseException as exc:
            error = encode_error(exc)
        if dist.is_initialized():  # here, not in the interpreter's finalization (groups.py)
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()
        self.reply("closed", error)


def _limit_files(fsize: tuple[int, int]) -> None:
    """Take the rank's RLIMIT_FSIZE now: one it set (or lifted) after this worker started."""
    if resource.getrlimit(resource.RLIMIT_FSIZE) == fsize:
        return
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, fsize)
    except (ValueError, OSError) as exc:
        raise WorkerError(
            type(exc).__name__,
            f"it cannot take its rank's RLIMIT_FSIZE {fsize} ({exc}): a hard limit raised after"
            " it started. Close the manager and build a new one (its worker starts under the"
            " new limit), or use executor='thread'",
        ) from exc


def _events(telemetry: Telemetry | None) -> list[Event]:
    return [] if telemetry is None else telemetry.memory.events()


def main(conn: Connection, lock: threading.Lock, parent: int) -> None:
    """Serve parent ``parent`` on ``conn`` (``lock`` guards its sends), until closed or orphaned."""
    # A save's check opens its manifest at most twice, back to back (deep: once in the full
    # check); what listings need goes back to the parent as a header. Keeping more parsed
    # manifests here only holds ~24 MiB each at 10,000 items.
    keep_parsed(1)
    with conn:
        _Worker(conn, lock, parent).serve()
