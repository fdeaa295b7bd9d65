"""How a root publishes a checkpoint, and the one object per save that does it.

:class:`RenameStrategy` or :class:`MarkerStrategy` (the two orbax-checkpoint uses too) is chosen
once from the backend; see docs/architecture.md, "How a root publishes". The control files'
writes and fsyncs are independent, so they run at once (on a journaling file system concurrent
fsyncs share a journal commit).

The strategy makes a :class:`Publication` per save: one save's commit of one name on one root,
from claim to release (docs/architecture.md, "One object per save: the publication"); and a
:class:`~dcp_safe.commit.replica.ReplicaPublication` per replica.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import TypeVar

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.fencing import check_fence, register_attempt
from dcp_safe.commit.lease import (
    Claimant,
    abandon_lease,
    acquire_lease,
    check_lease,
    held_by_another,
    release_lease,
)
from dcp_safe.commit.replica import ReplicaPublication
from dcp_safe.errors import CheckpointExistsError, ConfigError, DcpSafeError, StaleWriterError
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.manifest.signing import sign_digest

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Publication(abc.ABC):
    """Save ``save_id`` of checkpoint ``name`` on ``backend``, made by the root's strategy.

    Every rank of a save makes one from the same name and save id: the coordinator claims and
    publishes; every rank checks before it writes and abandons what it wrote when it fails.
    """

    strategy: PublishStrategy
    backend: Backend
    name: str
    save_id: str
    claimant: Claimant
    #: where the save writes before it is published (by default, where its strategy says)
    work_dir: str = ""
    #: whether the claim and the commit point check the fence: not a replica's, whose
    #: checkpoint was fenced where it was saved
    fenced: bool = True

    def __post_init__(self) -> None:
        if not self.work_dir:
            self.work_dir = self.strategy.work_dir(self.name, self.save_id)

    def claim(self, *, replace: bool = False, join: bool = False) -> bool:
        """Fence the save's attempt (StaleWriterError), then take the name for it before a byte
        is written (CheckpointExistsError: committed, and not being replaced, or held). With
        ``join``, share a lease this very save id holds already (a replica's, whose save id is
        its checkpoint's); True: it joined one, which is then not this publication's."""
        attempt = self.claimant.attempt
        if attempt is not None:
            register_attempt(self.backend, attempt)
            if self.fenced:
                check_fence(self.backend, attempt)
        return self._take(replace, join)

    @abc.abstractmethod
    def _take(self, replace: bool, join: bool) -> bool: ...

    def check(self) -> None:
        """Raise ``StaleWriterError`` if this save lost its name (another took it over).
        (A partial folder is this save's own: nobody else writes in it; the rename arbitrates.)"""
        return None

    def publish(
        self,
        marker: bytes,
        *,
        files: Mapping[str, bytes],
        sync_dirs: Sequence[str] = (),
        replace: bool = False,
    ) -> None:
        """:meth:`PublishStrategy.publish` of the work folder as ``name``, the fence and the
        claim checked right before the commit point too; then give up the claim.

        Raises:
            FileExistsError: ``name`` was committed meanwhile (and is not being replaced).
        """

        def before_commit() -> None:
            if self.fenced:
                check_fence(self.backend, self.claimant.attempt)
            self.check()

        self.check()
        self.strategy.publish(
            self.backend,
            self.work_dir,
            self.name,
            marker,
            files=files,
            sync_dirs=sync_dirs,
            replace=replace,
            before_commit=before_commit,
        )
        try:
            self.release()
        except OSError as exc:
            # Committed and whole: a lease left beside the marker is harmless (the sweeper
            # ignores committed names), so the save must not be reported as failed.
            log.warning("checkpoint %s committed; removing its lease failed: %s", self.name, exc)

    def publish_manifest(
        self,
        manifest: Manifest,
        control: Mapping[str, bytes],
        *,
        signing_key: bytes | None = None,
        replace: bool = False,
    ) -> None:
        """:meth:`publish` the save with ``manifest`` beside the other control files
        ``control`` (by path under the work folder), the manifest's digest its marker, the rank
        manifests made durable too. With ``signing_key``, its signature is written before the
        marker, like every file of the checkpoint: a committed signed checkpoint always has it.
        """
        raw = manifest.to_json()
        digest = manifest_digest(raw)
        files = {**control, layout.MANIFEST: raw}
        if signing_key is not None:
            files[layout.SIGNATURE] = sign_digest(signing_key, digest)
        self.publish(digest.encode(), files=files, sync_dirs=(layout.RANKS_DIR,), replace=replace)

    @abc.abstractmethod
    def discard(self, cause: BaseException) -> None:
        """After a failed publish: remove what the save wrote, while it is still this save's."""

    def abandon(self, own: Sequence[str], *, shared: bool) -> None:
        """After one rank failed: remove its files ``own`` (relative to the work folder) and give
        up the claim, unless the name is committed or another save's by now. With ``shared``
        (peers' files stay), mark the claim abandoned instead. Best effort. (A hidden partial:
        the coordinator or the sweeper removes it.)"""
        return None

    def release(self) -> None:
        """Give up the claim (nothing was written under it, or the save is committed)."""
        return None

    def _committed(self) -> bool:
        return self.backend.exists(f"{self.name}/{layout.COMMITTED_MARKER}")


class RenamedPublication(Publication):
    """A hidden partial folder of this save's own; one atomic rename publishes it."""

    def _take(self, replace: bool, join: bool) -> bool:
        if not replace and self._committed():
            raise CheckpointExistsError(self.backend.full_path(self.name))
        return False

    def discard(self, cause: BaseException) -> None:
        # If this fails too, it is a hidden partial: the sweeper collects it after a grace period.
        with contextlib.suppress(OSError):
            self.backend.remove_tree(self.work_dir)


class LeasedPublication(Publication):
    """Files written straight under ``<name>/`` behind a writing lease; the marker publishes."""

    def _take(self, replace: bool, join: bool) -> bool:
        return acquire_lease(self.backend, self.name, self.save_id, self.claimant, join=join)

    def check(self) -> None:
        check_lease(self.backend, self.name, self.save_id)

    def discard(self, cause: BaseException) -> None:
        if isinstance(cause, CheckpointExistsError):
            return  # another save's name now: nothing here is ours to remove
        with contextlib.suppress(OSError, StaleWriterError):
            self.check()
            if self._committed():
                return
            if self.backend.supports_exclusive_create:
                self.backend.remove_tree(self.name)  # the one lease there is ours
                return
            # Per-save leases: another save may be writing its lease right now, to take the name
            # once ours is gone. Its lease must survive, so remove the files, then our lease.
            for rel in list(self.backend.walk_files(self.name)):
                if "/" in rel or not layout.is_lease_file(rel):
                    self.backend.remove_file(f"{self.name}/{rel}")
            self.release()

    def abandon(self, own: Sequence[str], *, shared: bool) -> None:
        with contextlib.suppress(OSError, DcpSafeError):
            if self._committed() or held_by_another(self.backend, self.name, self.save_id):
                return
            for rel in own:
                self.backend.remove_file(f"{self.name}/{rel}")
            self.check()
            if shared:
                abandon_lease(self.backend, self.name, self.save_id, self.claimant)
            else:
                self.release()

    def release(self) -> None:
        release_lease(self.backend, self.name, self.save_id)


T = TypeVar("T")
_NO_FILES: Mapping[str, bytes] = MappingProxyType({})
_UNFENCED = Claimant()


class PublishStrategy(abc.ABC):
    """The publish protocol of one kind of root."""

    #: a save writes straight under ``<name>/`` (and holds the lease while it does).
    in_place: bool
    #: a committed checkpoint can be replaced atomically (``overwrite=True``).
    can_replace: bool
    #: what :meth:`publication` makes on this kind of root.
    _publication: type[Publication]

    def work_dir(self, name: str, save_id: str) -> str:
        """Where save ``save_id`` of ``name`` writes before it is published."""
        return name if self.in_place else layout.partial_dir_name(name, save_id)

    def publication(
        self, backend: Backend, name: str, save_id: str, claimant: Claimant = _UNFENCED
    ) -> Publication:
        """The publication of save ``save_id`` of ``name`` on ``backend`` (one per save)."""
        return self._publication(self, backend, name, save_id, claimant)

    def replica(
        self,
        backend: Backend,
        manifest: Manifest,
        digest: str,
        work_dir: str,
        claimant: Claimant = _UNFENCED,
    ) -> ReplicaPublication:
        """The publication on ``backend`` of a replica of a checkpoint committed elsewhere
        (``manifest``, whose digest is ``digest``), written under ``work_dir``."""
        publication = self._publication(
            self, backend, manifest.name, manifest.save_id, claimant, work_dir, fenced=False
        )
        return ReplicaPublication(publication, manifest, digest)

    def require_rename(self, why: str) -> None:
        """Refuse (ConfigError: ``why``) a root that cannot rename atomically."""
        if not self.can_replace:
            raise ConfigError(why)

    def sweep(self, partial_folders: Callable[[], T], leased_prefixes: Callable[[], T]) -> T:
        """Collect what this root's failed saves leave: hidden partial folders on a renaming
        root, leased prefixes on an object store (the caller's collector of each)."""
        return leased_prefixes() if self.in_place else partial_folders()

    def publish(
        self,
        backend: Backend,
        work_dir: str,
        name: str,
        marker: bytes,
        *,
        files: Mapping[str, bytes] = _NO_FILES,
        sync_dirs: Sequence[str] = (),
        replace: bool = False,
        before_commit: Callable[[], None] = lambda: None,
    ) -> None:
        """Write ``files`` (control files, by path under ``work_dir``) and the ``_COMMITTED``
        marker (exclusively), durably, and make ``work_dir`` checkpoint ``name``. The entries of
        ``sync_dirs`` (under ``work_dir``: the rank manifests, say) are made durable too;
        ``before_commit`` (fence, lease) runs right before the commit point: raising there
        publishes nothing.

        Raises:
            FileExistsError: ``name`` is committed already (and not being replaced).
        """
        calls = [partial(backend.write_bytes, f"{work_dir}/{r}", d) for r, d in files.items()]
        if not self.in_place:  # the marker goes in the partial folder; the rename publishes it
            marker_path = f"{work_dir}/{layout.COMMITTED_MARKER}"
            calls.append(partial(backend.write_bytes, marker_path, marker, exclusive=True))
        calls += [partial(backend.sync_dir, f"{work_dir}/{rel}") for rel in sync_dirs]
        with ThreadPoolExecutor(len(calls) or 1, thread_name_prefix="dcp_safe-sync") as pool:
            futures = [pool.submit(call) for call in calls]
        for future in futures:  # the first error in the order given, once none is running
            future.result()
        backend.sync_dir(work_dir)  # after every entry in it was created
        before_commit()
        self._commit(backend, work_dir, name, marker, replace)

    @abc.abstractmethod
    def _commit(
        self, backend: Backend, work_dir: str, name: str, marker: bytes, replace: bool
    ) -> None:
        """The commit point (the rename, or the marker): make the durable ``work_dir``
        checkpoint ``name``."""

    @abc.abstractmethod
    def retire(self, backend: Backend, name: str) -> None:
        """Unpublish checkpoint ``name`` in one step, then delete what it held."""

    # The trash (dcp_safe.retention.trash): ``<name>/_TRASHED`` is written first, then one
    # step here takes the checkpoint out of the listings; restoring undoes it.
    #: A name holding this beside its commit marker is not listed (a trash step cut short);
    #: ``None`` where the trash is a renamed folder and a stray marker means nothing.
    hidden_by: str | None = None

    @abc.abstractmethod
    def trash(self, backend: Backend, name: str) -> None:
        """Move committed ``name``, its trash marker written, to the trash in one step."""

    @abc.abstractmethod
    def trashed(self, backend: Backend) -> list[tuple[str, str]]:
        """``(name, folder)`` of each checkpoint in the trash, sorted."""

    @abc.abstractmethod
    def untrash(self, backend: Backend, folder: str, name: str) -> None:
        """Bring ``name`` back from the trash ``folder`` (its commit marker back in it);
        CheckpointExistsError if ``name`` is committed anew meanwhile."""


class RenameStrategy(PublishStrategy):
    """Work in a hidden partial directory; one atomic rename publishes it."""

    in_place = False
    can_replace = True

    _publication = RenamedPublication

    def _commit(
        self, backend: Backend, work_dir: str, name: str, marker: bytes, replace: bool
    ) -> None:
        parked = backend.publish_dir(work_dir, name, replace=replace)
        backend.sync_dir("")
        if parked is not None:
            # The replaced checkpoint is no longer reachable by name; reclaim its space.
            backend.remove_tree(parked)

    def retire(self, backend: Backend, name: str) -> None:
        parked = layout.partial_dir_name(name, layout.new_save_id())
        backend.publish_dir(name, parked, replace=False)
        backend.sync_dir("")
        backend.remove_tree(parked)

    def trash(self, backend: Backend, name: str) -> None:
        backend.publish_dir(name, layout.trash_dir_name(name), replace=False)
        backend.sync_dir("")

    def trashed(self, backend: Backend) -> list[tuple[str, str]]:
        listed = ((layout.trashed_name(entry), entry) for entry in backend.list_dir(""))
        return sorted((name, entry) for name, entry in listed if name is not None)

    def untrash(self, backend: Backend, folder: str, name: str) -> None:
        try:
            backend.publish_dir(folder, name, replace=False)
        except FileExistsError:
            raise CheckpointExistsError(backend.full_path(name), "committed anew") from None
        backend.sync_dir("")
        # A stray one left by a crash here means nothing under a name on such a root.
        backend.remove_file(f"{name}/{layout.TRASH_MARKER}")


class MarkerStrategy(PublishStrategy):
    """Work under ``<name>/`` behind a lease; creating the marker exclusively publishes it."""

    in_place = True
    can_replace = False
    hidden_by = layout.TRASH_MARKER

    _publication = LeasedPublication

    def _commit(
        self, backend: Backend, work_dir: str, name: str, marker: bytes, replace: bool
    ) -> None:
        backend.write_bytes(f"{name}/{layout.COMMITTED_MARKER}", marker, exclusive=True)
        backend.sync_dir(name)

    def retire(self, backend: Backend, name: str) -> None:
        backend.remove_file(f"{name}/{layout.COMMITTED_MARKER}")
        backend.remove_tree(name)

    def trash(self, backend: Backend, name: str) -> None:
        backend.remove_file(f"{name}/{layout.COMMITTED_MARKER}")  # its trash marker hides it

    def trashed(self, backend: Backend) -> list[tuple[str, str]]:
        return [(name, name) for name in backend.entries_holding(layout.TRASH_MARKER)]

    def untrash(self, backend: Backend, folder: str, name: str) -> None:
        backend.remove_file(f"{name}/{layout.TRASH_MARKER}")  # back in the listings


_RENAME = RenameStrategy()
_MARKER = MarkerStrategy()


def strategy_for(backend: Backend) -> PublishStrategy:
    """The strategy for ``backend``, from its capability flags (the only place that reads them)."""
    return _RENAME if backend.supports_atomic_rename else _MARKER
