"""The remote tier's commit of a checkpoint already committed locally: open, check, publish.

Both ways to the remote tier end here: the single-process
:class:`~dcp_safe.replication.replicator.Replicator` and the per-rank uploads of
:mod:`dcp_safe.replication.rank_upload`. The remote ``manifest.json`` is the local one, byte
for byte, so both tiers' markers hold the same digest. The protocol, and why the remote writing
lease (:class:`RemoteLease`) of the same save id is shared: docs/architecture.md, "Replication
and the remote tier" and "The writing lease".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.commit.lease import (
    check_lease,
    held_by_another,
    holds_lease,
    join_or_acquire_lease,
    own_lease_file,
    release_lease,
)
from dcp_safe.commit.strategy import PublishStrategy, strategy_for
from dcp_safe.commit.takeover import Claimant
from dcp_safe.errors import CheckpointCorruptError, CheckpointExistsError, StaleWriterError
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest

__all__ = ["RemoteLease", "open_source", "publish_remote", "remote_committed", "remove_uploads"]

log = logging.getLogger(__name__)


def open_source(local: Backend, name: str) -> tuple[Manifest, bytes]:
    """The committed local manifest and its exact bytes (the remote copy must be identical).

    Raises:
        CheckpointNotFoundError: ``name`` is not committed locally.
        CheckpointCorruptError: its marker and manifest disagree, or it changed while opened.
    """
    manifest = open_committed(local, name).manifest
    rel = f"{name}/{layout.MANIFEST}"
    raw = local.read_small(rel, MANIFEST_MAX_BYTES)
    if Manifest.from_json(raw, local.full_path(rel)) != manifest:
        raise CheckpointCorruptError(local.full_path(rel), "manifest changed while being opened")
    return manifest, raw


def remote_committed(remote: Backend, name: str, digest: str) -> bool:
    """True when ``remote`` holds ``name`` committed with ``digest``.

    Raises:
        CheckpointExistsError: it is committed there with another digest.
        CheckpointCorruptError: its marker is ours but its manifest does not match it.
    """
    try:
        marker = remote.read_small(f"{name}/{layout.COMMITTED_MARKER}", CONTROL_MAX_BYTES)
    except FileNotFoundError:
        return False
    if marker.decode("ascii", errors="replace").strip() != digest:
        raise CheckpointExistsError(remote.full_path(name))
    open_committed(remote, name)
    return True


class RemoteLease:
    """A replication's writing lease on ``name`` on a marker-published ``remote``.

    Call order: :meth:`take` before the first upload (rank 0 only, in a multi-rank save);
    :meth:`check` before each file uploaded and right before the marker; then :meth:`release`
    after the marker, or :meth:`abandon` on failure (:func:`publish_remote` calls these last
    three). The rule on sharing: docs/architecture.md, "The writing lease".

    Args:
        save_id: the checkpoint's save id (its manifest's), never a fresh one: it is what makes
            a second writer of the same checkpoint recognisable.
        digest: the manifest's digest, which the remote marker will hold.
        claimant: the replicating process's attempt (and stale-lease bound): what the lease
            records, and which lease of another save id it takes over
            (:mod:`dcp_safe.commit.takeover`); default: unfenced, taking nothing over.
    """

    def __init__(
        self,
        remote: Backend,
        name: str,
        save_id: str,
        digest: str,
        claimant: Claimant | None = None,
    ) -> None:
        try:
            layout.lease_file_name(save_id)
        except ValueError as exc:
            raise CheckpointCorruptError(
                remote.full_path(name),
                f"its manifest's save id {save_id!r} cannot name a writing lease: {exc}",
            ) from None
        self.remote, self.name, self.save_id, self.digest = remote, name, save_id, digest
        self.claimant = claimant or Claimant()
        self.joined = False

    def take(self) -> bool:
        """Take (or join) the lease.

        Returns:
            False when ``name`` got committed with this digest meanwhile (nothing to do).

        Raises:
            CheckpointExistsError: another save holds the name (and its lease may not be taken
                over), or committed it.
        """
        try:
            self.joined = join_or_acquire_lease(self.remote, self.name, self.save_id, self.claimant)
        except CheckpointExistsError:
            if remote_committed(self.remote, self.name, self.digest):
                return False
            raise
        return True

    def check(self) -> None:
        """Raises StaleWriterError unless the lease still shows this save id."""
        check_lease(self.remote, self.name, self.save_id)

    def release(self) -> None:
        """After the marker: remove the lease. Never raises: the checkpoint is committed and
        whole, and a lease beside a marker is harmless (the sweeper ignores committed names)."""
        try:
            release_lease(self.remote, self.name, self.save_id)
        except Exception as exc:
            log.warning("replica %s committed; removing its lease failed: %s", self.name, exc)

    def abandon(self, uploaded: Sequence[str]) -> None:
        """On failure, best effort, never raising: remove ``uploaded`` and then the lease, if
        this replication took the lease and still holds it (files first, so that no other save
        writes there meanwhile); otherwise leave both to their holder or the sweeper."""
        with contextlib.suppress(Exception):
            if self.joined or not holds_lease(self.remote, self.name, self.save_id):
                return
            remove_uploads(self.remote, self.name, uploaded)
            own = own_lease_file(self.remote, self.save_id)
            if list(self.remote.walk_files(self.name)) == [own]:
                self.remote.remove_tree(self.name)  # the lease and any empty folders at once
            else:
                release_lease(self.remote, self.name, self.save_id)  # peers' markers stay

    def remove_part(self, uploaded: Sequence[str]) -> None:
        """On failure of a rank that uploads under rank 0's lease: best effort, never raising,
        remove ``uploaded`` unless another save holds the name now (the paths may be its)."""
        with contextlib.suppress(Exception):
            if not held_by_another(self.remote, self.name, self.save_id):
                remove_uploads(self.remote, self.name, uploaded)


def publish_remote(
    remote: Backend,
    name: str,
    digest: str,
    work_dir: str,
    upload: Callable[[], None],
    uploaded: Sequence[str],
    *,
    lease: RemoteLease | None = None,
) -> None:
    """Run ``upload`` (which fills ``work_dir``), then publish it as ``name`` (never replacing).

    On failure, what this process uploaded (``uploaded``, filled by ``upload``) is removed on a
    marker-published remote (with ``lease``: as :meth:`RemoteLease.abandon` says), and the
    partial directory on a renaming one; both best effort.

    Args:
        lease: on a marker-published remote, the lease taken before ``upload`` wrote anything;
            checked right before the marker, released after it.

    Raises:
        CheckpointExistsError: ``name`` is committed on ``remote`` with another digest.
        StaleWriterError: the lease was lost before the marker, and ``name`` is not committed
            with this digest.
        BaseException: whatever ``upload`` or the publish raised.
    """
    strategy = strategy_for(remote)
    try:
        _upload_and_publish(strategy, remote, name, digest, work_dir, upload, lease)
    except BaseException:
        if lease is not None:
            lease.abandon(uploaded)
        elif strategy.in_place:
            remove_uploads(remote, name, uploaded)
        raise
    finally:
        if not strategy.in_place:
            # Best effort, never hiding the real error; absent once published (a no-op then).
            # A partial left behind is collected by the sweeper after its grace period.
            with contextlib.suppress(Exception):
                remote.remove_tree(work_dir)
    if lease is not None:
        lease.release()


def _upload_and_publish(
    strategy: PublishStrategy,
    remote: Backend,
    name: str,
    digest: str,
    work_dir: str,
    upload: Callable[[], None],
    lease: RemoteLease | None,
) -> None:
    try:
        upload()
        try:
            strategy.publish(
                remote,
                work_dir,
                name,
                digest.encode(),
                before_commit=lease.check if lease is not None else lambda: None,
            )
        except FileExistsError as exc:
            # e.g. published meanwhile, reply lost: fine if it is ours
            if not remote_committed(remote, name, digest):
                raise CheckpointExistsError(remote.full_path(name)) from exc
    except StaleWriterError:
        # The same save's other writer may have published and released the shared lease first.
        if lease is None or not remote_committed(remote, name, digest):
            raise


def remove_uploads(remote: Backend, name: str, uploaded: Sequence[str]) -> None:
    """Best effort: drop what this attempt uploaded, unless ``name`` got committed meanwhile
    (then the objects may be a committed checkpoint's, ours or another writer's). Never
    raises: the caller is already raising the error that matters."""
    with contextlib.suppress(Exception):
        if remote.exists(f"{name}/{layout.COMMITTED_MARKER}"):
            return
        for rel in uploaded:
            remote.remove_file(rel)
        if not any(True for _ in remote.walk_files(name)):
            remote.remove_tree(name)  # empty directories, where the backend has them
