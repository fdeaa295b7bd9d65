"""Where a checkpoint lives: the roles of a save's roots, decided once.

See docs/architecture.md, "Topology".
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
    """The roots of a save and their roles (docs/architecture.md, "Topology").

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
