"""``ReplicaPublication``: the commit of a replica of a checkpoint already committed elsewhere
(docs/architecture.md, "One object per save: the publication", "Replication and the remote
tier")."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.lease import held_by_another, holds_lease, own_lease_file
from dcp_safe.errors import CheckpointCorruptError, CheckpointExistsError, StaleWriterError
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest, manifest_digest

if TYPE_CHECKING:
    from dcp_safe.commit.strategy import Publication

log = logging.getLogger(__name__)


def committed_with(remote: Backend, name: str, digest: str) -> bool:
    """Whether ``remote`` holds ``name`` committed with ``digest`` (its manifest is then the
    source's, byte for byte); CheckpointExistsError when committed with another digest,
    CheckpointCorruptError when its manifest does not match its marker."""
    try:
        marker = remote.read_small(f"{name}/{layout.COMMITTED_MARKER}", CONTROL_MAX_BYTES)
    except FileNotFoundError:
        return False
    if marker.decode("ascii", errors="replace").strip() != digest:
        raise CheckpointExistsError(remote.full_path(name))
    rel = f"{name}/{layout.MANIFEST}"
    try:
        raw = remote.read_small(rel, MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointCorruptError(remote.full_path(rel), "marker without manifest") from None
    if manifest_digest(raw) != digest:
        raise CheckpointCorruptError(
            remote.full_path(rel), f"does not match its {layout.COMMITTED_MARKER} marker"
        )
    return True


def _remove_uploads(remote: Backend, name: str, uploaded: Sequence[str]) -> None:
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


@dataclass(eq=False)
class ReplicaPublication:
    """The replica of checkpoint ``manifest`` (whose digest is ``digest``), published on its
    remote by ``publication``: of the checkpoint's own save id, written under the work folder
    the replicator chose, and not fenced (the checkpoint was, where it was saved). On a
    renaming remote the rename arbitrates; on a marker remote, a writing lease of that save id,
    taken or joined (the same checkpoint's other writers share it).

    Call order: :meth:`claim` before the first upload (rank 0 only in a multi-rank save; the
    others wait for :meth:`held`); :meth:`check` before each file uploaded; then
    :meth:`publish`, or on a failure outside it :meth:`abandon` (the publisher) or
    :meth:`remove_part` (another rank).
    """

    publication: Publication
    manifest: Manifest
    digest: str
    #: whether :meth:`claim` joined a lease already there (then it is not this replica's)
    joined: bool = False

    def __post_init__(self) -> None:
        if not self._leased:
            return
        try:
            layout.lease_file_name(self.manifest.save_id)
        except ValueError as exc:
            raise CheckpointCorruptError(
                self.remote.full_path(self.name),
                f"its manifest's save id {self.manifest.save_id!r} cannot name a writing lease:"
                f" {exc}",
            ) from None

    @property
    def _leased(self) -> bool:
        return self.publication.strategy.in_place

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def remote(self) -> Backend:
        return self.publication.backend

    @property
    def work_dir(self) -> str:
        return self.publication.work_dir

    def claim(self) -> bool:
        """Take the name for this replica (CheckpointExistsError: another save holds or
        committed it). False: committed with this digest meanwhile."""
        if not self._leased:
            return True  # the rename arbitrates; no attempt is recorded on such a remote
        try:
            self.joined = self.publication.claim(join=True)
        except CheckpointExistsError:
            if committed_with(self.remote, self.name, self.digest):
                return False
            raise
        return True

    def check(self) -> None:
        """Raise ``StaleWriterError`` if this replica lost its claim on the name."""
        self.publication.check()

    def held(self) -> bool | None:
        """For a rank waiting for the publisher's claim: True once it is held, False when the
        name got committed with this digest meanwhile, None while neither."""
        try:
            self.publication.check()
        except StaleWriterError:
            return False if committed_with(self.remote, self.name, self.digest) else None
        return True

    def publish(self, upload: Callable[[], None], uploaded: Sequence[str]) -> None:
        """Run ``upload`` (which fills the work folder and ``uploaded``), then publish it as
        ``name``, never replacing; on failure remove what it can of this save. Raises
        CheckpointExistsError when ``name`` is committed on the remote with another digest,
        StaleWriterError when the claim was lost before the commit point and it is not."""
        try:
            upload()
            try:
                self.publication.publish(self.digest.encode(), files={})
                return  # and the claim given up
            except FileExistsError as exc:
                # e.g. published meanwhile, reply lost: fine if it is ours
                if not committed_with(self.remote, self.name, self.digest):
                    raise CheckpointExistsError(self.remote.full_path(self.name)) from exc
        except StaleWriterError:
            # The same save's other writer may have published and released the shared lease.
            if not committed_with(self.remote, self.name, self.digest):
                self._failed(uploaded)
                raise
        except BaseException:
            self._failed(uploaded)
            raise
        # Published by another writer of this checkpoint: give up the claim, or the folder.
        if not self._leased:
            self._failed(uploaded)
            return
        try:
            self.publication.release()
        except Exception as exc:
            log.warning("replica %s committed; removing its lease failed: %s", self.name, exc)

    def _failed(self, uploaded: Sequence[str]) -> None:
        if self._leased:
            self.abandon(uploaded)
            return
        # The whole work folder goes (``abandon``, rank 0's own part failing, keeps the
        # failure marker it wrote there for its peers). Best effort, never hiding the real
        # error; a partial left behind is collected by the sweeper later.
        with contextlib.suppress(Exception):
            self.remote.remove_tree(self.work_dir)

    def abandon(self, uploaded: Sequence[str]) -> None:
        """The publisher's clean-up after a failure; best effort, never raising. On a marker
        remote: every object of the save, then the lease, if this replica took the lease and
        still holds it; otherwise both are left to their holder or the sweeper."""
        if not self._leased:
            _remove_uploads(self.remote, self.name, uploaded)
            return
        names = [r.path for r in self.manifest.files] + [layout.SIGNATURE, layout.MANIFEST]
        objects = list(dict.fromkeys([f"{self.name}/{n}" for n in names] + list(uploaded)))
        save_id = self.manifest.save_id
        with contextlib.suppress(Exception):
            if self.joined or not holds_lease(self.remote, self.name, save_id):
                return
            _remove_uploads(self.remote, self.name, objects)
            own = own_lease_file(self.remote, save_id)
            if list(self.remote.walk_files(self.name)) == [own]:
                self.remote.remove_tree(self.name)  # the lease and any empty folders at once
            else:
                self.publication.release()  # peers' markers stay

    def remove_part(self, uploaded: Sequence[str]) -> None:
        """Another rank's clean-up after its failure: its own uploads, unless another save
        holds the name now (the paths may be its). Best effort, never raising."""
        with contextlib.suppress(Exception):
            if not held_by_another(self.remote, self.name, self.manifest.save_id):
                _remove_uploads(self.remote, self.name, uploaded)
