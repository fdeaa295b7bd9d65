"""The remote tier's commit of a checkpoint already committed locally: open, check, publish.

Both ways to the remote tier end here: the single-process
:class:`~dcp_safe.replication.replicator.Replicator` and the per-rank uploads of
:mod:`dcp_safe.replication.rank_upload`. The remote copy's ``manifest.json`` is the local one,
byte for byte, so both tiers' markers hold the same digest: a second replication of the same
checkpoint is recognised (idempotent), and another checkpoint of that name is never replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import CheckpointCorruptError, CheckpointExistsError
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest

__all__ = ["open_source", "publish_remote", "remote_committed", "remove_uploads"]


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


def publish_remote(
    remote: Backend,
    name: str,
    digest: str,
    work_dir: str,
    upload: Callable[[], None],
    uploaded: Sequence[str],
) -> None:
    """Run ``upload`` (which fills ``work_dir``), then publish it as ``name`` (never replacing).

    On failure, what this process uploaded (``uploaded``, filled by ``upload``) is removed on a
    marker-published remote, and the partial directory on a renaming one; both best effort.

    Raises:
        CheckpointExistsError: ``name`` is committed on ``remote`` with another digest.
        BaseException: whatever ``upload`` or the publish raised.
    """
    strategy = strategy_for(remote)
    try:
        upload()
        try:
            strategy.publish(remote, work_dir, name, digest.encode())
        except FileExistsError as exc:
            # e.g. published meanwhile, reply lost: fine if it is ours
            if not remote_committed(remote, name, digest):
                raise CheckpointExistsError(remote.full_path(name)) from exc
    except BaseException:
        if strategy.in_place:
            remove_uploads(remote, name, uploaded)
        raise
    finally:
        if not strategy.in_place:
            # Best effort, never hiding the real error; absent once published (a no-op then).
            # A partial left behind is collected by the sweeper after its grace period.
            with contextlib.suppress(Exception):
                remote.remove_tree(work_dir)


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
