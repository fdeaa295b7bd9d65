"""Replication of a multi-rank checkpoint from one shared local root: each rank uploads its part.

The steps, the markers, and why a save is replicated by all ranks or by none:
docs/architecture.md, "Per-rank uploads".
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.retry import RetryPolicy
from dcp_safe.commit.replica import ReplicaPublication, committed_with
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.commit.takeover import Claimant
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CommitError,
    ReplicationSkippedError,
)
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, Manifest, RankManifest, manifest_digest
from dcp_safe.replication.copying import CheckpointCopy, open_source
from dcp_safe.replication.engine import Job
from dcp_safe.replication.rank_upload import (
    UploadOptions,
    await_arrivals,
    await_remote_commit,
    raise_reported_failures,
    remote_work_dir,
    report_commit_failure,
    report_rank_failure,
    report_rank_skipped,
    upload_rank_part,
)
from dcp_safe.replication.replicator import Replicator

__all__ = ["RankReplicator", "RankSave"]


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

    Args:
        retry: how a file upload that fails transiently is started over.
        claimant: as :func:`~dcp_safe.replication.replicator.replicate_checkpoint` takes it.
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
        self._ended: set[str] = set()  # saves known to have ended on this rank
        self._copying = threading.Lock()  # one copy at a time: max_buffer_bytes holds

    def begin(self, name: str, save: RankSave) -> Future[Manifest]:
        """Start replicating this rank's part of save ``save`` of ``name`` in the background."""
        name = layout.validate_name(name)
        with self._cond:
            self._ended.update(self._saves)
            self._ended.discard(name)
            self._saves[name] = save
            for old in [n for n in self._saves if n != name and n not in self._futures]:
                del self._saves[old]
                self._ended.discard(old)
        return self.submit(name)

    def end_saves(self) -> None:
        """Every save begun so far has ended on this rank (committed locally, or failed)."""
        with self._cond:
            self._ended.update(self._saves)

    def close(self, timeout_s: float | None = None) -> None:
        self.end_saves()
        super().close(timeout_s)

    # ----------------------------------------------------------------- worker

    def _skipped(self, name: str, *, superseded_by: str) -> None:
        with self._cond:
            save = self._saves.get(name)
        if save is not None:
            work = remote_work_dir(self.remote, name, save.save_id)
            report_rank_skipped(self.remote, work, save.rank, save.save_id, superseded_by)

    def _run_job(self, name: str) -> Manifest | Job:
        with self._cond:
            save = self._saves[name]
        work = remote_work_dir(self.remote, name, save.save_id)
        manifest, raw = self._await_local_commit(name, save, work)
        digest = manifest_digest(raw)
        if committed_with(self.remote, name, digest):
            return manifest  # replicated before (every rank sees the same)
        replica = strategy_for(self.remote).replica(
            self.remote, manifest, digest, work, self.claimant or Claimant()
        )
        if not self._await_claim(replica, save, work):
            return manifest  # the same checkpoint got committed meanwhile
        copy = CheckpointCopy(
            self.local,
            self.remote,
            name,
            manifest,
            raw,
            self.chunk_bytes,
            retry=self.retry,
            before_each=replica.check,
        )
        try:
            with self._copying:
                upload_rank_part(
                    self.local,
                    name,
                    self.remote,
                    work,
                    save.rank,
                    chunk_bytes=self.chunk_bytes,
                    retry=self.retry,
                    uploaded=copy.uploaded,
                    expected=_record(copy, layout.rank_manifest_name(save.rank)),
                    before_each=copy.before_each,
                )
        except Exception as exc:
            report_rank_failure(self.remote, work, save.rank, save.save_id, exc)
            self._remove_part(replica, save, copy)
            raise CommitError(
                f"rank {save.rank} could not upload its part of {name}; nothing was published",
                {save.rank: f"{type(exc).__name__}: {exc}"},
            ) from exc
        waits = self._commit if save.rank == 0 else self._await_commit
        return functools.partial(waits, copy, save, work, replica)

    def _await_commit(
        self, copy: CheckpointCopy, save: RankSave, work: str, replica: ReplicaPublication
    ) -> Manifest:
        """A rank other than 0: wait (bounded) until rank 0 committed the save remotely."""
        try:
            return await_remote_commit(self.remote, copy.name, work, save.save_id, self.options)
        except BaseException:
            self._remove_part(replica, save, copy)
            raise

    def _await_claim(self, replica: ReplicaPublication, save: RankSave, work: str) -> bool:
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

    def _remove_part(
        self, replica: ReplicaPublication, save: RankSave, copy: CheckpointCopy
    ) -> None:
        """On failure: rank 0 removes what it can of the whole save; another rank its own."""
        if save.rank == 0:
            replica.abandon(copy.uploaded)
        else:
            replica.remove_part(copy.uploaded)

    def _await_local_commit(self, name: str, save: RankSave, work: str) -> tuple[Manifest, bytes]:
        def committed() -> tuple[Manifest, bytes] | None:
            with self._cond:
                ended = name in self._ended
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

    def _commit(
        self,
        copy: CheckpointCopy,
        save: RankSave,
        work: str,
        replica: ReplicaPublication,
    ) -> Manifest:
        """Rank 0: once every rank arrived, upload the rest and publish as the Replicator does."""
        name = copy.name

        def upload() -> None:
            await_arrivals(self.remote, work, save.save_id, name, save.world_size, self.options)
            with self._copying:
                copy.copy_files(work, self._unowned_files(copy.manifest, name, save.world_size))
                copy.finish_upload(work)

        try:
            replica.publish(upload, copy.uploaded)
        except ReplicationSkippedError:
            raise  # every rank sees the skip marker itself
        except BaseException as exc:
            report_commit_failure(self.remote, work, save.save_id, exc)
            raise
        return copy.manifest

    def _unowned_files(self, manifest: Manifest, name: str, world_size: int) -> list[FileRecord]:
        """The checkpoint's files no rank uploads as its own part (``.metadata``)."""
        owned: set[str] = set()
        for rank in range(world_size):
            rel = f"{name}/{layout.rank_manifest_name(rank)}"
            raw = self.local.read_small(rel, MANIFEST_MAX_BYTES)
            part = RankManifest.from_json(raw, self.local.full_path(rel))
            owned.update(f.path for f in part.files)
            owned.add(layout.rank_manifest_name(rank))
        return [f for f in manifest.files if f.path not in owned]


def _record(copy: CheckpointCopy, rel: str) -> FileRecord:
    record = copy.records.get(rel)
    if record is None:
        raise CheckpointCorruptError(
            copy.local.full_path(f"{copy.name}/{layout.MANIFEST}"), f"manifest does not list {rel}"
        )
    return record
