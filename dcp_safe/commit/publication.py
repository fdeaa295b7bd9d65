"""``Publication``: one save's commit of one name on one root, from claim to release.

See docs/architecture.md, "One object per save: the publication".
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from dcp_safe.errors import CheckpointExistsError, DcpSafeError, StaleWriterError

if TYPE_CHECKING:
    from dcp_safe.commit.strategy import PublishStrategy

__all__ = ["LeasedPublication", "Publication", "RenamedPublication"]

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

    @property
    def work_dir(self) -> str:
        """Where the save's files are written before it is published."""
        return self.strategy.work_dir(self.name, self.save_id)

    def claim(self, *, replace: bool = False) -> None:
        """Fence the save's attempt, then take the name for it before a byte is written.

        Raises:
            StaleWriterError: a newer attempt saves under this root.
            CheckpointExistsError: the name is committed (and not being replaced) or held.
        """
        attempt = self.claimant.attempt
        if attempt is not None:
            register_attempt(self.backend, attempt)
            check_fence(self.backend, attempt)
        self._take(replace)

    @abc.abstractmethod
    def _take(self, replace: bool) -> None: ...

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``StaleWriterError`` if this save lost its name (another took it over)."""

    def publish(
        self,
        marker: bytes,
        *,
        files: Mapping[str, bytes],
        sync_dirs: Sequence[str] = (),
        replace: bool = False,
    ) -> None:
        """Write ``files`` and the marker durably and make the work folder checkpoint ``name``;
        then give up the claim. The fence and the claim are checked right before the commit
        point too, so a save that lost either publishes nothing.

        Raises:
            FileExistsError: ``name`` was committed meanwhile (and is not being replaced).
        """
        attempt = self.claimant.attempt

        def before_commit() -> None:
            check_fence(self.backend, attempt)
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

    @abc.abstractmethod
    def discard(self, cause: BaseException) -> None:
        """After a failed publish: remove what the save wrote, while it is still this save's."""

    @abc.abstractmethod
    def abandon(self, own: Sequence[str], *, shared: bool) -> None:
        """After one rank failed: remove its files ``own`` (relative to the work folder) and give
        up the claim, unless the name is committed or another save's by now. With ``shared``
        (peers' files stay), mark the claim abandoned instead. Best effort."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give up the claim (nothing was written under it, or the save is committed)."""


class RenamedPublication(Publication):
    """A hidden partial folder of this save's own; one atomic rename publishes it."""

    def _take(self, replace: bool) -> None:
        if not replace and self.backend.exists(f"{self.name}/{layout.COMMITTED_MARKER}"):
            raise CheckpointExistsError(self.backend.full_path(self.name))

    def check(self) -> None:
        return None  # nobody else writes in this save's partial folder; the rename arbitrates

    def discard(self, cause: BaseException) -> None:
        # If this fails too, it is a hidden partial: the sweeper collects it after a grace period.
        with contextlib.suppress(OSError):
            self.backend.remove_tree(self.work_dir)

    def abandon(self, own: Sequence[str], *, shared: bool) -> None:
        return None  # a hidden partial: the coordinator or the sweeper removes it

    def release(self) -> None:
        return None


class LeasedPublication(Publication):
    """Files written straight under ``<name>/`` behind a writing lease; the marker publishes."""

    def _take(self, replace: bool) -> None:
        acquire_lease(self.backend, self.name, self.save_id, self.claimant)

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

    def _committed(self) -> bool:
        return self.backend.exists(f"{self.name}/{layout.COMMITTED_MARKER}")
