"""A node's local root: its node cache, and its peer copies of other nodes' shares, of
checkpoints committed on the shared remote root. This module owns that layout: publishing,
opening, listing and pruning both (docs/architecture.md, "Node caches", "The peer tier").

The node cache ``<root>/<name>/`` holds that node's share and copies of the remote
``manifest.json`` and ``.metadata``, marked ``_NODE_COMMITTED``, never ``_COMMITTED``:
everything that looks for checkpoints passes it by. A peer copy
``<root>/.peers/<name>/from_node_NNNNN/`` holds node N's share and the remote manifest, marked
``_PEER_COMMITTED``; it is used only where that manifest is the remote's committed one. Both
are whole under their name (:func:`~dcp_safe.checkpoints.committed.publish_marked`).

Why under a hidden ``.peers/``: a node cache's ``<name>/`` is that node's own share (its
``_NODE_COMMITTED`` says so); another node's share beside it would make ``list_node_caches``
claim ranks this node never wrote, and everything that lists a node root passes hidden names by.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import committed_names, publish_marked, read_marked_manifest
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest
from dcp_safe.topology import RootLike
from dcp_safe.untrusted import shown

log = logging.getLogger(__name__)

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
    """Turn the node's hidden work directory ``work`` into the node cache ``<name>/``, once per
    node (the lowest rank), after ``name`` is committed on ``remote`` with ``manifest``.
    CheckpointCorruptError: the remote manifest changed since it was opened;
    CheckpointExistsError: ``<name>/`` exists on this node's root already; StorageError: a local
    or remote I/O step failed."""
    raw = remote.read_small(f"{name}/{layout.MANIFEST}", MANIFEST_MAX_BYTES)
    if Manifest.from_json(raw, remote.full_path(name)) != manifest:
        raise CheckpointCorruptError(remote.full_path(name), "manifest changed while read")
    metadata = remote.read_small(f"{name}/{layout.DCP_METADATA}", MANIFEST_MAX_BYTES)
    local.write_bytes(f"{work}/{layout.DCP_METADATA}", metadata)
    publish_marked(local, work, name, raw, NODE_COMMITTED_MARKER, "a node cache")


def open_node_cache(backend: Backend, name: str) -> NodeCache:
    """Open the node cache ``name`` under ``backend``'s root, checking its marker (errors as
    :func:`~dcp_safe.checkpoints.committed.read_marked_manifest`'s)."""
    path = backend.full_path(name)
    raw, _ = read_marked_manifest(backend, name, NODE_COMMITTED_MARKER, "node cache", path)
    ranks = tuple(sorted(ranks_in(backend, name)))
    return NodeCache(name, path, ranks, Manifest.from_json(raw, path))


def list_node_caches(root: RootLike | Backend) -> list[NodeCache]:
    """The node caches published under a node-local ``root``, oldest first.

    Entries whose marker does not match their manifest are left out; so are names that break
    the name rule (:func:`~dcp_safe.layout.validate_name`), with a warning.
    """
    backend = root if isinstance(root, Backend) else open_backend(root)
    caches = []
    for entry in committed_names(backend, NODE_COMMITTED_MARKER):
        with contextlib.suppress(CheckpointNotFoundError, CheckpointCorruptError):
            caches.append(open_node_cache(backend, entry))
    return sorted(caches, key=lambda cache: (cache.manifest.created_at, cache.name))


def prune_node_caches(backend: Backend, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` node caches under ``backend``'s root; the names
    removed. Frees node-local disk only: the remote's retention is separate."""
    caches = list_node_caches(backend)
    doomed = [cache.name for cache in caches[: max(0, len(caches) - keep)]]
    for name in doomed:
        backend.remove_tree(name)
    return doomed


def held_files(backend: Backend, folder: str, manifest: Manifest) -> dict[str, int]:
    """The files of ``manifest`` that ``folder`` holds at their recorded size (its rank
    manifests in ``_ranks/`` among them), by path in the checkpoint."""
    sizes = backend.sizes(folder)
    ranks = backend.sizes(f"{folder}/{layout.RANKS_DIR}")
    sizes |= {f"{layout.RANKS_DIR}/{rank}": size for rank, size in ranks.items()}
    return {f.path: f.size for f in manifest.files if sizes.get(f.path) == f.size}


def ranks_in(backend: Backend, directory: str) -> list[int]:
    """Ranks whose rank manifest is in ``directory``'s ``_ranks/``."""
    entries = backend.list_dir(f"{directory}/{layout.RANKS_DIR}")
    return [rank for rank in map(layout.rank_of_manifest, entries) if rank is not None]


# ----------------------------------------------------------------- peer copies


@dataclass(frozen=True)
class PeerCopy:
    """One committed peer copy: node ``node``'s files of checkpoint ``name``."""

    name: str
    node: int
    path: str
    rel: str  # relative to the node root: where the files are
    manifest: Manifest


def commit_peer_copy(
    local: Backend, partial: str, name: str, node: int, raw_manifest: bytes
) -> str:
    """Make the landed files in ``partial`` (``.metadata`` among them, each checked as it
    landed) the peer copy of node ``node``'s share of ``name``, as :func:`publish_marked` does
    (CheckpointExistsError: a committed copy of that share is there already); its folder,
    relative to ``local``'s root."""
    final = layout.peer_copy_dir(name, node)
    publish_marked(local, partial, final, raw_manifest, layout.PEER_COMMITTED_MARKER, "a peer copy")
    return final


def open_peer_copy(local: Backend, name: str, node: int) -> PeerCopy:
    """Open node ``node``'s peer copy of ``name``, checking its marker (errors as
    :func:`~dcp_safe.checkpoints.committed.read_marked_manifest`'s)."""
    rel = layout.peer_copy_dir(name, node)
    path = local.full_path(rel)
    raw, _ = read_marked_manifest(local, rel, layout.PEER_COMMITTED_MARKER, "peer copy", path)
    return PeerCopy(name, node, path, rel, Manifest.from_json(raw, path))


def list_peer_copies(local: Backend, name: str | None = None) -> list[PeerCopy]:
    """The committed peer copies under ``local``'s root (of ``name`` only, if given), oldest
    checkpoint first. Copies whose marker does not match their manifest are left out."""
    names = [name] if name is not None else local.list_dir(layout.PEERS_DIR)
    copies = []
    for entry in names:
        if not layout.is_valid_name(entry):
            continue  # a restore's scratch folder, or something that is no checkpoint name
        for folder in local.list_dir(f"{layout.PEERS_DIR}/{entry}"):
            node = layout.peer_node_of(folder)
            if node is None:
                continue  # a partial copy
            try:
                copies.append(open_peer_copy(local, entry, node))
            except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                log.warning("passed by: peer copy %s: %s", shown(folder), exc)
    return sorted(copies, key=lambda c: (c.manifest.created_at, c.name, c.node))


def prune_peer_copies(local: Backend, keep: int) -> list[str]:
    """Remove the peer copies of all but the newest ``keep`` checkpoints held here, with any
    partial copies of those names. Returns the names removed (node-local disk only)."""
    held = {entry for entry in local.list_dir(layout.PEERS_DIR) if layout.is_valid_name(entry)}
    newest = list(dict.fromkeys(copy.name for copy in reversed(list_peer_copies(local))))
    doomed = sorted(held - set(newest[:keep]))
    for name in doomed:
        local.remove_tree(f"{layout.PEERS_DIR}/{name}")
    return doomed
