"""How a root publishes a checkpoint: one strategy object, chosen once from the backend.

Two ways to make "all or nothing" true on storage (the same two orbax-checkpoint uses):

* :class:`RenameStrategy` (POSIX): a save works in a hidden ``.<name>.partial-<id>/``
  directory, writes the ``_COMMITTED`` marker there, and one atomic rename publishes it (never
  over a committed checkpoint unless replacing, and then by an atomic exchange). Retiring
  renames the checkpoint away first, so it stops existing in one step.
* :class:`MarkerStrategy` (object stores): there is no atomic rename (fsspec's ``mv`` on S3 is
  copy + delete), so a save works directly under ``<name>/``, guarded by a writing lease
  (:mod:`dcp_safe.commit.lease`, which also covers storage without a real exclusive create), and
  publishing is creating the marker exclusively, last. Retiring deletes the marker first.

The commit point differs (the rename, or the marker), so the check a caller must make just
before it (the writer fence, the lease) is passed in as ``before_commit`` and called at that
point by the strategy. Everything above this module asks the strategy, never the backend's
``supports_atomic_rename`` flag.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.lease import acquire_lease

__all__ = ["MarkerStrategy", "PublishStrategy", "RenameStrategy", "strategy_for"]


class PublishStrategy(abc.ABC):
    """The publish protocol of one kind of root (see the module docstring)."""

    #: a save writes straight under ``<name>/`` (and holds the lease while it does).
    in_place: bool
    #: a committed checkpoint can be replaced atomically (``overwrite=True``).
    can_replace: bool

    def work_dir(self, name: str, save_id: str) -> str:
        """Where save ``save_id`` of ``name`` writes before it is published."""
        return name if self.in_place else layout.partial_dir_name(name, save_id)

    @abc.abstractmethod
    def claim(self, backend: Backend, name: str, save_id: str) -> None:
        """Take ``name`` for this save before a byte is written (the lease, or nothing)."""

    @abc.abstractmethod
    def publish(
        self,
        backend: Backend,
        work_dir: str,
        name: str,
        marker: bytes,
        *,
        replace: bool = False,
        before_commit: Callable[[], None] = lambda: None,
    ) -> None:
        """Write the ``_COMMITTED`` marker (exclusively) and make ``work_dir`` checkpoint ``name``.

        Raises:
            FileExistsError: ``name`` is committed already (and not being replaced).
        """

    @abc.abstractmethod
    def retire(self, backend: Backend, name: str) -> None:
        """Unpublish checkpoint ``name`` in one step, then delete what it held."""


class RenameStrategy(PublishStrategy):
    """Work in a hidden partial directory; one atomic rename publishes it."""

    in_place = False
    can_replace = True

    def claim(self, backend: Backend, name: str, save_id: str) -> None:
        return None  # the partial directory is this save's own; the rename arbitrates

    def publish(
        self,
        backend: Backend,
        work_dir: str,
        name: str,
        marker: bytes,
        *,
        replace: bool = False,
        before_commit: Callable[[], None] = lambda: None,
    ) -> None:
        backend.write_bytes(f"{work_dir}/{layout.COMMITTED_MARKER}", marker, exclusive=True)
        backend.sync_dir(work_dir)
        before_commit()  # the commit point is the rename
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


class MarkerStrategy(PublishStrategy):
    """Work under ``<name>/`` behind a lease; creating the marker exclusively publishes it."""

    in_place = True
    can_replace = False

    def claim(self, backend: Backend, name: str, save_id: str) -> None:
        acquire_lease(backend, name, save_id)

    def publish(
        self,
        backend: Backend,
        work_dir: str,
        name: str,
        marker: bytes,
        *,
        replace: bool = False,
        before_commit: Callable[[], None] = lambda: None,
    ) -> None:
        if replace:
            raise ValueError("a marker-published root cannot replace a committed checkpoint")
        before_commit()  # the commit point is the marker
        backend.write_bytes(f"{name}/{layout.COMMITTED_MARKER}", marker, exclusive=True)
        backend.sync_dir(name)

    def retire(self, backend: Backend, name: str) -> None:
        backend.remove_file(f"{name}/{layout.COMMITTED_MARKER}")
        backend.remove_tree(name)


_RENAME = RenameStrategy()
_MARKER = MarkerStrategy()


def strategy_for(backend: Backend) -> PublishStrategy:
    """The strategy for ``backend``, from its capability flags (the only place that reads them)."""
    return _RENAME if backend.supports_atomic_rename else _MARKER
