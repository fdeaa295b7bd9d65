"""Replication: copy a committed local checkpoint to the remote tier and commit it there.

:func:`replicate_checkpoint` does one checkpoint; :class:`Replicator` runs them on the upload
engine's lane, coalescing to the newest name (docs/architecture.md, "Replication and the remote
tier" and "One process"). :class:`RankReplicator` replicates a multi-rank checkpoint from one
shared local root: each rank uploads its part; the steps, the markers, and why a save is
replicated by all ranks or by none: docs/architecture.md, "Per-rank uploads".
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.retry import RetryPolicy
from dcp_safe.commit.lease import Claimant
from dcp_safe.commit.replica import ReplicaPublication, committed_with
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    ReplicationSkippedError,
    ReplicationTimeoutError,
    describe,
)
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, Manifest, RankManifest, manifest_digest
from dcp_safe.manifest.verify import DEFAULT_CHUNK_BYTES
from dcp_safe.replication.copying import CheckpointCopy, copy_buffer_bytes, open_source
from dcp_safe.replication.engine import Job, UploadEngine
from dcp_safe.replication.rank_upload import (
    UploadOptions,
    await_arrivals,
    await_remote_commit,
    raise_reported_failures,
    report_commit_failure,
    report_rank_failure,
    report_rank_skipped,
    upload_rank_part,
)


def replicate_checkpoint(
    local: Backend,
    remote: Backend,
    name: str,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    claimant: Claimant | None = None,
) -> Manifest:
    """Copy committed checkpoint ``name`` from ``local`` to ``remote`` and commit it there.

    Returns its manifest. Idempotent: nothing is copied when ``remote`` already holds ``name``
    committed with the same digest (its marker trusted, as every reader trusts it).
    ``chunk_bytes`` bounds the memory a copy holds (:func:`.copying.copy_buffer_bytes`);
    ``claimant`` is this process's job attempt, as the remote lease records it.

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
    replicator = Replicator(local, remote, chunk_bytes=chunk_bytes, claimant=claimant)
    manifest = replicator._run_job(layout.validate_name(name))
    assert isinstance(manifest, Manifest)  # a Replicator's job has no commit wait
    return manifest


class Replicator(UploadEngine):
    """Replicates newly committed checkpoints from ``local`` to ``remote``, in the background.

    Call order: the owner (the writer, after a local commit) calls :meth:`submit` with each
    committed name, from any thread; results arrive through the returned futures; the owner
    calls :meth:`close` once at the end. Threads, coalescing to the newest name and errors are
    :class:`~dcp_safe.replication.engine.UploadEngine`'s.
    """

    def __init__(
        self,
        local: Backend,
        remote: Backend,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        claimant: Claimant | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
        super().__init__(f"replication to {remote.url}", thread_name="dcp_safe-replicator")
        self.local = local
        self.remote = remote
        self.chunk_bytes = chunk_bytes
        self.claimant = claimant
        self.retry: RetryPolicy | None = None  # how a failed file upload is started over

    @property
    def max_buffer_bytes(self) -> int | None:
        """The most host bytes a replication holds at once (:func:`copy_buffer_bytes`): a
        memory budget counts it beside staging, as it stays held while the next save stages.
        None where the remote's buffering is not known."""
        return copy_buffer_bytes(self.remote, self.chunk_bytes)

    def _run_job(self, name: str) -> Manifest | Job:
        manifest, raw = open_source(self.local, name)
        work = strategy_for(self.remote).work_dir(name, layout.new_save_id())
        opened = self._open_replica(manifest, raw, work)
        if opened is not None:
            replica, copy = opened
            replica.publish(lambda: copy.upload_to(work), copy.uploaded)
        return manifest

    def _open_replica(
        self,
        manifest: Manifest,
        raw: bytes,
        work: str,
        claim: Callable[[ReplicaPublication], bool] | None = None,
    ) -> tuple[ReplicaPublication, CheckpointCopy] | None:
        """The writing lease on ``manifest``'s name (taken by ``claim``, default: claimed here)
        and the copy to upload into ``work`` under it; ``None`` when the remote holds that very
        checkpoint committed already (every rank sees the same), or got it meanwhile."""
        name, digest = manifest.name, manifest_digest(raw)
        if committed_with(self.remote, name, digest):
            return None
        claimant = self.claimant or Claimant()
        replica = strategy_for(self.remote).replica(self.remote, manifest, digest, work, claimant)
        if not (replica.claim() if claim is None else claim(replica)):
            return None
        copy = CheckpointCopy(
            self.local,
            self.remote,
            name,
            manifest,
            raw,
            chunk_bytes=self.chunk_bytes,
            retry=self.retry,
            before_each=replica.check,
        )
        return replica, copy


@dataclass(frozen=True)
class RankSave:
    """This rank's share of one save: what ``SafeStorageWriter.prepare_global_plan`` assigned."""

    save_id: str
    rank: int
    world_size: int


class RankReplicator(Replicator):
    """Uploads this rank's part of each multi-rank checkpoint committed under a shared root.

    Call order: :meth:`begin` once per save, right after this rank wrote its files (it also
    tells the replicator that every earlier save on this rank has ended); :meth:`future` for
    the outcome (the remote manifest once ``_COMMITTED`` exists there, or the cause);
    :meth:`close` once at the end. Errors, coalescing and threads are the engine's: the upload
    runs on its lane, the wait for the remote commit (rank 0: for every rank's part, then the
    publish) on a thread of its own, so the next save's upload never waits behind it.
    """

    def __init__(
        self,
        local: Backend,
        remote: Backend,
        *,
        options: UploadOptions | None = None,
        retry: RetryPolicy | None = None,
        claimant: Claimant | None = None,
    ) -> None:
        self.options = options or UploadOptions()
        super().__init__(local, remote, chunk_bytes=self.options.chunk_bytes, claimant=claimant)
        self.retry = retry
        self._saves: dict[str, RankSave] = {}
        self._open: str | None = None  # the one save not known to have ended on this rank
        self._copying = threading.Lock()  # one copy at a time: max_buffer_bytes holds

    def begin(self, name: str, save: RankSave) -> Future[Manifest]:
        """Start replicating this rank's part of save ``save`` of ``name`` in the background."""
        name = layout.validate_name(name)
        with self._cond:
            self._open, self._saves[name] = name, save  # every earlier save has ended
            for old in [n for n in self._saves if n != name and n not in self._futures]:
                del self._saves[old]
        return self.submit(name)

    def end_saves(self) -> None:
        """Every save begun so far has ended on this rank (committed locally, or failed)."""
        with self._cond:
            self._open = None

    def close(self, timeout_s: float | None = None) -> None:
        self.end_saves()
        super().close(timeout_s)

    def _skipped(self, name: str, *, superseded_by: str) -> None:
        with self._cond:
            save = self._saves.get(name)
        if save is not None:
            work = strategy_for(self.remote).work_dir(name, save.save_id)
            report_rank_skipped(self.remote, work, save.rank, save.save_id, superseded_by)

    def _run_job(self, name: str) -> Manifest | Job:
        with self._cond:
            save = self._saves[name]
        work = strategy_for(self.remote).work_dir(name, save.save_id)
        manifest, raw = self._await_local_commit(name, save, work)
        claim = functools.partial(self._await_claim, save=save, work=work)
        opened = self._open_replica(manifest, raw, work, claim)
        if opened is None:
            return manifest
        replica, copy = opened
        rel = layout.rank_manifest_name(save.rank)
        try:
            record = manifest.file(rel)
            if record is None:
                where = self.local.full_path(f"{name}/{layout.MANIFEST}")
                raise CheckpointCorruptError(where, f"manifest does not list {rel}")
            with self._copying:
                upload_rank_part(copy, name, work, save.rank, record)
        except Exception as exc:
            report_rank_failure(self.remote, work, save.rank, save.save_id, exc)
            # Rank 0 removes what it can of the whole save; another rank its own part.
            (replica.abandon if save.rank == 0 else replica.remove_part)(copy.uploaded)
            raise CommitError(
                f"rank {save.rank} could not upload its part of {name}; nothing was published",
                {save.rank: describe(exc)},
            ) from exc
        return functools.partial(self._finish, copy, save, work, replica)

    def _finish(
        self, copy: CheckpointCopy, save: RankSave, work: str, replica: ReplicaPublication
    ) -> Manifest:
        """The commit wait: rank 0 uploads the rest once every rank arrived and publishes as
        the Replicator does; another rank waits (bounded) until rank 0 committed remotely."""
        if save.rank != 0:
            try:
                return await_remote_commit(self.remote, copy.name, work, save.save_id, self.options)
            except ReplicationTimeoutError:
                # Rank 0 may still publish (its commit retrying through an outage): the part
                # stays, or the checkpoint published would lack it; the sweeper removes it if
                # rank 0 never publishes. A manager's remote verdict settles the outcome.
                raise
            except BaseException:
                replica.remove_part(copy.uploaded)
                raise

        def upload() -> None:
            await_arrivals(
                self.remote, work, save.save_id, copy.name, save.world_size, self.options
            )
            with self._copying:
                copy.copy_files(work, self._unowned_files(copy.manifest, save.world_size))
                copy.finish_upload(work)

        try:
            replica.publish(upload, copy.uploaded)
        except ReplicationSkippedError:
            raise  # every rank sees the skip marker itself
        except BaseException as exc:
            report_commit_failure(self.remote, work, save.save_id, exc)
            raise
        return copy.manifest

    def _await_claim(self, replica: ReplicaPublication, *, save: RankSave, work: str) -> bool:
        """Rank 0 claims the name; the other ranks wait, bounded, until it is held or a peer
        reports a failure. False: the name got committed with this digest meanwhile."""
        if save.rank == 0:
            try:
                return replica.claim()
            except BaseException as exc:
                report_commit_failure(self.remote, work, save.save_id, exc)
                raise
        name = replica.name

        def held() -> bool | None:
            state = replica.held()
            if state is None:
                raise_reported_failures(self.remote, work, save.save_id, name)
            return state

        return self.options.poll(held, f"rank 0's writing lease on {self.remote.full_path(name)}")

    def _await_local_commit(self, name: str, save: RankSave, work: str) -> tuple[Manifest, bytes]:
        def committed() -> tuple[Manifest, bytes] | None:
            with self._cond:
                ended = name != self._open
            try:
                manifest, raw = open_source(self.local, name)
            except (CheckpointNotFoundError, CheckpointCorruptError, OSError):
                manifest = None  # not published yet
            if manifest is not None and manifest.save_id == save.save_id:
                return manifest, raw
            raise_reported_failures(self.remote, work, save.save_id, name)
            if ended:
                raise CommitError(f"save {save.save_id} of {name} was not committed locally")
            return None

        return self.options.poll(
            committed, f"{self.local.full_path(name)}/{layout.COMMITTED_MARKER}"
        )

    def _unowned_files(self, manifest: Manifest, world_size: int) -> list[FileRecord]:
        """The checkpoint's files no rank uploads as its own part (``.metadata``)."""
        name, owned = manifest.name, set[str]()
        for rank in range(world_size):
            rel = f"{name}/{layout.rank_manifest_name(rank)}"
            raw = self.local.read_small(rel, MANIFEST_MAX_BYTES)
            part = RankManifest.from_json(raw, self.local.full_path(rel))
            owned.update(f.path for f in part.files)
            owned.add(layout.rank_manifest_name(rank))
        return [f for f in manifest.files if f.path not in owned]
