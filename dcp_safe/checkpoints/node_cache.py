"""The node cache: a node's share of a checkpoint committed on the shared remote root.

``<root>/<name>/`` holds that node's shard files and rank manifests, copies of the remote
``manifest.json`` and ``.metadata``, and a ``_NODE_COMMITTED`` marker (written before the
rename, so a cache under its name is always whole), never ``_COMMITTED``: everything that looks
for checkpoints passes it by. This module owns that layout: publishing a cache, opening one and
listing them (docs/architecture.md, "Node caches").
"""

from __future__ import annotations

from dataclasses import dataclass

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import committed_names, publish_marked, read_marked_manifest
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest
from dcp_safe.topology import RootLike

__all__ = [
    "NODE_COMMITTED_MARKER",
    "NodeCache",
    "list_node_caches",
    "open_node_cache",
    "prune_node_caches",
    "publish_node_cache",
    "ranks_in",
]

NODE_COMMITTED_MARKER = layout.NODE_COMMITTED_MARKER


@dataclass(frozen=True)
class NodeCache:
    """One published node cache: a node's share of a checkpoint committed on the remote."""

    name: str
    path: str
    ranks: tuple[int, ...]
    manifest: Manifest


def publish_node_cache(
    local: Backend, remote: Backend, work: str, name: str, manifest: Manifest
) -> None:
    """Turn the node's hidden work directory ``work`` into the node cache ``<name>/``.

    Call it once per node (the lowest rank), after ``name`` is committed on ``remote`` with
    ``manifest``.

    Raises:
        CheckpointCorruptError: the remote manifest changed since it was opened.
        CheckpointExistsError: ``<name>/`` already exists on this node's root.
        StorageError: a local or remote I/O step failed.
    """
    raw = remote.read_small(f"{name}/{layout.MANIFEST}", MANIFEST_MAX_BYTES)
    if Manifest.from_json(raw, remote.full_path(name)) != manifest:
        raise CheckpointCorruptError(remote.full_path(name), "manifest changed while read")
    metadata = remote.read_small(f"{name}/{layout.DCP_METADATA}", MANIFEST_MAX_BYTES)
    local.write_bytes(f"{work}/{layout.DCP_METADATA}", metadata)
    publish_marked(local, work, name, raw, NODE_COMMITTED_MARKER, "a node cache")


def open_node_cache(backend: Backend, name: str) -> NodeCache:
    """Open the node cache ``name`` under ``backend``'s root, checking its marker.

    Raises:
        CheckpointNotFoundError: no ``<name>/`` with a ``_NODE_COMMITTED`` marker.
        CheckpointCorruptError: the manifest is missing, unreadable, or not the one the marker
            names.
    """
    path = backend.full_path(name)
    raw, _ = read_marked_manifest(backend, name, NODE_COMMITTED_MARKER, "node cache", path)
    manifest = Manifest.from_json(raw, path)
    ranks = tuple(sorted(ranks_in(backend, name)))
    return NodeCache(name, path, ranks, manifest)


def list_node_caches(
    root: RootLike | Backend,
) -> list[NodeCache]:
    """The node caches published under a node-local ``root``, oldest first.

    Entries whose marker does not match their manifest are left out; so are names that break
    the name rule (:func:`~dcp_safe.layout.validate_name`), with a warning.
    """
    backend = root if isinstance(root, Backend) else open_backend(root)
    caches = []
    for entry in committed_names(backend, NODE_COMMITTED_MARKER):
        try:
            caches.append(open_node_cache(backend, entry))
        except (CheckpointNotFoundError, CheckpointCorruptError):
            continue
    return sorted(caches, key=lambda cache: (cache.manifest.created_at, cache.name))


def prune_node_caches(backend: Backend, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` node caches under ``backend``'s root.

    Returns the names removed. Frees node-local disk only: the remote's retention is separate.
    """
    caches = list_node_caches(backend)
    doomed = [cache.name for cache in caches[: max(0, len(caches) - keep)]]
    for name in doomed:
        backend.remove_tree(name)
    return doomed


def ranks_in(backend: Backend, directory: str) -> list[int]:
    """Ranks whose rank manifest is in ``directory``'s ``_ranks/``."""
    entries = backend.list_dir(f"{directory}/{layout.RANKS_DIR}")
    return [rank for rank in map(layout.rank_of_manifest, entries) if rank is not None]
