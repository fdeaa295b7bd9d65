"""Replication: copy a committed local checkpoint to the remote tier and commit it there.

:func:`replicate_checkpoint` does one checkpoint; :class:`Replicator` runs them on the upload
engine's lane, coalescing to the newest name. See docs/architecture.md, "Replication and
the remote tier" and "One process".
"""

from __future__ import annotations

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.replica import committed_with
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.commit.takeover import Claimant
from dcp_safe.errors import ConfigError, ReplicationSkippedError, ReplicationTimeoutError
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.replication.copying import (
    DEFAULT_CHUNK_BYTES,
    CheckpointCopy,
    copy_buffer_bytes,
    copy_file_verified,
    open_source,
)
from dcp_safe.replication.engine import DEFAULT_KEEP_DONE, Job, UploadEngine

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ReplicationSkippedError",
    "ReplicationTimeoutError",
    "Replicator",
    "copy_file_verified",
    "replicate_checkpoint",
]

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

    Returns its manifest. Idempotent: nothing is copied when ``remote`` already holds ``name``
    committed with the same digest (its marker trusted, as every reader trusts it).

    Args:
        chunk_bytes: bytes read and handed to the remote file at a time (the memory a copy
            holds: :func:`~dcp_safe.replication.copying.copy_buffer_bytes`).
        claimant: this process's job attempt, as the remote lease records it (and what it may
            take over: :mod:`dcp_safe.commit.takeover`).

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


class Replicator(UploadEngine):
    """Replicates newly committed checkpoints from ``local`` to ``remote``, in the background.

    Call order: the owner (the writer, after a local commit) calls :meth:`submit` with each
    committed name, from any thread; results arrive through the returned futures; the owner
    calls :meth:`close` once at the end. Threads, coalescing to the newest name and errors are
    :class:`~dcp_safe.replication.engine.UploadEngine`'s.

    Args:
        keep_done: how many finished futures :meth:`future` can still return.
        chunk_bytes, claimant: as :func:`replicate_checkpoint` takes them.
    """

    def __init__(
        self,
        local: Backend,
        remote: Backend,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_done: int = DEFAULT_KEEP_DONE,
        claimant: Claimant | None = None,
    ) -> None:
        if chunk_bytes < 1 or keep_done < 0:
            raise ConfigError("chunk_bytes must be positive and keep_done not negative")
        super().__init__(
            f"replication to {remote.url}", keep_done=keep_done, thread_name="dcp_safe-replicator"
        )
        self.local = local
        self.remote = remote
        self.chunk_bytes = chunk_bytes
        self.claimant = claimant

    @property
    def max_buffer_bytes(self) -> int | None:
        """The most host bytes a replication holds at once (:func:`copy_buffer_bytes`): a
        memory budget counts it beside staging, as it stays held while the next save stages.
        None where the remote's buffering is not known."""
        return copy_buffer_bytes(self.remote, self.chunk_bytes)

    def _run_job(self, name: str) -> Manifest | Job:
        """One replication, on the worker thread (a subclass may do it its own way)."""
        return replicate_checkpoint(
            self.local, self.remote, name, chunk_bytes=self.chunk_bytes, claimant=self.claimant
        )
