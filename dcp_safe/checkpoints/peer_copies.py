"""Peer copies: another node's share of a checkpoint, held in this node's local root.

``<node root>/.peers/<name>/from_node_NNNNN/`` holds node N's files of ``name`` (shard
files, rank manifests, ``.metadata``), the remote ``manifest.json``, and a ``_PEER_COMMITTED``
marker with the manifest's digest, written last, inside a hidden partial folder that is then
renamed into place: a peer copy under its name is always whole. It is used only where that
manifest is the remote's committed one. This module owns that layout: committing a copy, opening
one, listing and pruning them (docs/architecture.md, "The peer tier").

Why under a hidden ``.peers/``: a node cache's ``<name>/`` is that node's own share (its
``_NODE_COMMITTED`` says so); another node's share beside it would make ``list_node_caches``
claim ranks this node never wrote, and everything that lists a node root passes hidden names by.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import publish_marked, read_marked_manifest
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.untrusted import shown

__all__ = [
    "PeerCopy",
    "commit_peer_copy",
    "list_peer_copies",
    "open_peer_copy",
    "prune_peer_copies",
]

log = logging.getLogger(__name__)


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
    """Make the landed files in ``partial`` the peer copy of node ``node``'s share of ``name``.

    The files (``.metadata`` among them) are in ``partial``, each checked as it landed; the
    manifest goes in, then the marker last, then the rename. Returns the copy's folder
    (relative to ``local``'s root).

    Raises:
        CheckpointExistsError: a committed copy of that node's share is there already.
        StorageError: an I/O step failed.
    """
    final = layout.peer_copy_dir(name, node)
    publish_marked(local, partial, final, raw_manifest, layout.PEER_COMMITTED_MARKER, "a peer copy")
    return final


def open_peer_copy(local: Backend, name: str, node: int) -> PeerCopy:
    """Open node ``node``'s peer copy of ``name``, checking its marker.

    Raises:
        CheckpointNotFoundError: no such copy with a ``_PEER_COMMITTED`` marker.
        CheckpointCorruptError: the manifest is missing, unreadable, or not the one the marker
            names.
    """
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
    kept = set(newest[:keep])
    doomed = sorted(held - kept)
    for name in doomed:
        local.remove_tree(f"{layout.PEERS_DIR}/{name}")
    return doomed
