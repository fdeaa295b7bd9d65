"""Where a checkpoint lives: the roles of a save's roots, decided once.

A save has one **commit** root, where a checkpoint is published and where history, retention
and ``latest`` live. Beside it there may be a **replica** (``replicate_to=``: every checkpoint
committed on the commit root is copied there and committed there too) or a **node cache**
(``node_local=``: every rank writes to its own node's disk, uploads its files to the commit
root, and the node keeps them as a cache for the next restore; never a checkpoint). The two
are the two ways to a second root, and they do not go together.

The manager builds one :class:`Topology` from its arguments; a writer says its own
(``writer.topology``). Everything that needs to know which root plays which role asks it,
rather than re-deriving roles from the writer's options. See docs/architecture.md, "Topology".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dcp_safe.errors import ConfigError

__all__ = ["Root", "Topology"]


@dataclass(frozen=True)
class Root:
    """One storage root: a local directory or an fsspec URL, and its fsspec options."""

    url: str
    storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"a root is a non-empty path or URL, got {self.url!r}")


@dataclass(frozen=True)
class Topology:
    """The roots of a save and their roles.

    Args:
        commit: where checkpoints are published (and history, retention, ``latest`` live).
        replica: a second root every committed checkpoint is copied to and committed on.
        node_cache: this node's local root: ranks write there first and upload to ``commit``;
            what stays there is a cache of this node's files, never a checkpoint.

    Raises:
        ConfigError: both ``replica`` and ``node_cache`` (a node-local save already uploads to
            its commit root; a replica of it is a second copy nothing would read).
    """

    commit: Root
    replica: Root | None = None
    node_cache: Root | None = None

    def __post_init__(self) -> None:
        if self.replica is not None and self.node_cache is not None:
            raise ConfigError(
                "node_local= and replicate_to= do not go together: with node_local, root is the"
                " shared remote every rank uploads to"
            )

    @classmethod
    def of(
        cls,
        root: str | os.PathLike[str],
        *,
        replicate_to: str | os.PathLike[str] | None = None,
        node_local: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        replica_storage_options: dict[str, Any] | None = None,
    ) -> Topology:
        """The topology of the manager's arguments: ``root`` commits; ``replicate_to`` is a
        replica (its options default to ``storage_options``); ``node_local`` a node cache
        (always a local directory, so it takes no fsspec options)."""
        replica = None
        if replicate_to is not None:
            options = replica_storage_options or storage_options
            replica = Root(os.fspath(replicate_to), options)
        node_cache = None if node_local is None else Root(os.fspath(node_local))
        return cls(Root(os.fspath(root), storage_options), replica, node_cache)

    @property
    def writes_to(self) -> Root:
        """Where ``write_data`` writes a rank's files: its node cache, else the commit root."""
        return self.node_cache or self.commit

    @property
    def uploads_to(self) -> Root | None:
        """Where a save's files are copied after they are written: the replica, the commit root
        of a node-local save, or nowhere."""
        if self.node_cache is not None:
            return self.commit
        return self.replica
