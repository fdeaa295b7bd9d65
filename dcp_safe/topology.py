"""Where a checkpoint lives: the roles of a save's roots, decided once.

See docs/architecture.md, "Topology".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from dcp_safe.choices import refuse_moved, require_int
from dcp_safe.errors import ConfigError


@dataclass(frozen=True)
class Root:
    """One storage root: a local directory or an fsspec URL, and its fsspec options."""

    url: str
    storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"a root is a non-empty path or URL, got {self.url!r}")


#: The options of a second root that were keywords beside it, and where each went: inside it.
TOPOLOGY_MOVED = {
    "replica_storage_options": "replicate_to=Root(url, storage_options=...)",
}

#: What a public entry point takes for a root: a path, a URL, or a Root with its options.
RootLike = str | os.PathLike[str] | Root


def as_root(root: RootLike, storage_options: dict[str, Any] | None = None) -> Root:
    """``root`` as one value: a Root as given, else the path or URL with ``storage_options``
    (the shorthand some entry points keep: docs/manager.md, "Where each option went"), never
    both (which options would it mean?)."""
    if not isinstance(root, Root):
        return Root(os.fspath(root), storage_options)
    if storage_options is not None:
        raise ConfigError(
            "storage_options= beside a Root: give them inside it, Root(url, storage_options=...)"
        )
    return root


@dataclass(frozen=True)
class Topology:
    """The roots of a save and their roles (docs/architecture.md, "Topology").

    ``peer_copies``: how many nodes hold each node's files (its own included): 1, no peer
    tier; K > 1, each node cache is also copied into the node caches of K - 1 other nodes
    (``<node cache>/.peers/``), so a restore after losing a node reads them from a peer.
    A ``replica`` beside a ``node_cache`` is refused: a node-local save already uploads to its
    commit root, and a replica of it would be a second copy nothing reads.
    """

    commit: Root
    replica: Root | None = None
    node_cache: Root | None = None
    peer_copies: int = 1

    def __post_init__(self) -> None:
        if self.replica is not None and self.node_cache is not None:
            raise ConfigError(
                "node_local= and replicate_to= do not go together: with node_local, root is the"
                " shared remote every rank uploads to"
            )
        require_int("peer_copies", self.peer_copies, 1)
        if self.peer_copies > 1 and self.node_cache is None:
            raise ConfigError(
                "peer_copies= needs node_local=: peer copies are node caches held on other"
                " nodes; without node-local disks every rank already reads the one shared root"
            )

    @classmethod
    def of(
        cls,
        root: RootLike,
        *,
        replicate_to: RootLike | None = None,
        node_local: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        peer_copies: int = 1,
        **moved: Any,
    ) -> Topology:
        """The topology of the manager's arguments: ``root`` commits; ``replicate_to`` is a
        replica (its options default to the commit root's); ``node_local`` a node cache
        (always a local directory, so it takes no fsspec options), with ``peer_copies``. Each
        root may be a Root, its options inside it (not beside it too). A keyword that moved
        into a root (:data:`TOPOLOGY_MOVED`) raises a ConfigError naming where.
        """
        refuse_moved("Topology.of", moved, TOPOLOGY_MOVED)
        commit = as_root(root, storage_options)
        replica = None
        if isinstance(replicate_to, Root):
            replica = replicate_to
        elif replicate_to is not None:  # the commit root's options, by default
            replica = dataclasses.replace(commit, url=os.fspath(replicate_to))
        node_cache = None if node_local is None else Root(os.fspath(node_local))
        return cls(commit, replica, node_cache, peer_copies)

    @property
    def writes_to(self) -> Root:
        """Where ``write_data`` writes a rank's files: its node cache, else the commit root."""
        return self.node_cache or self.commit

    @property
    def uploads_to(self) -> Root | None:
        """Where a save's files are copied after they are written: the replica, the commit root
        of a node-local save, or nowhere."""
        return self.commit if self.node_cache is not None else self.replica


def this_node(rank: int) -> int:
    """This process's node, as torchrun numbers them: ``GROUP_RANK`` if set, else ``rank //
    LOCAL_WORLD_SIZE`` (1 when unset), so nodes can be simulated on one machine."""
    group = os.environ.get("GROUP_RANK")
    if group is not None:
        if not group.isdigit():
            raise ConfigError(f"GROUP_RANK must be a non-negative integer, got {group!r}")
        return int(group)
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not local.isdigit() or int(local) < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE must be a positive integer, got {local!r}")
    return rank // int(local)
