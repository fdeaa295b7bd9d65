"""On-storage names and the commit rule, each defined once.

A checkpoint exists when, and only when, its ``_COMMITTED`` marker exists and holds the digest of
its ``manifest.json``. Everything else under a root (hidden partial directories, files without a
marker) is work in progress or debris, never a checkpoint. One root-level name is reserved:
``_ATTEMPTS/``, where :mod:`dcp_safe.commit.fencing` records which job attempts saved there.
"""

from __future__ import annotations

import re
import uuid

from dcp_safe.errors import InvalidCheckpointNameError

__all__ = [
    "ATTEMPTS_DIR",
    "COMMITTED_MARKER",
    "DCP_METADATA",
    "LATEST",
    "MANIFEST",
    "PARTIAL_INFIX",
    "RANKS_DIR",
    "SHARD_SUFFIX",
    "WRITING_LEASE",
    "is_partial_entry",
    "new_save_id",
    "partial_dir_name",
    "rank_manifest_name",
    "shard_file_name",
    "validate_name",
]

COMMITTED_MARKER = "_COMMITTED"
WRITING_LEASE = "_WRITING"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
RANKS_DIR = "_ranks"
ATTEMPTS_DIR = "_ATTEMPTS"
SHARD_SUFFIX = ".distcp"
PARTIAL_INFIX = ".partial-"
LATEST = "latest"

_MAX_NAME_LEN = 200
_ALLOWED = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]*$")


def validate_name(name: object) -> str:
    """Return ``name`` if it is a safe checkpoint name, else raise.

    Raises:
        InvalidCheckpointNameError: empty, with a path separator, ``..``, a leading dot, the
            reserved words ``latest`` and ``_ATTEMPTS``, or characters outside
            ``[A-Za-z0-9_.=+-]``.
    """
    if not isinstance(name, str):
        raise InvalidCheckpointNameError(name, f"expected a str, got {type(name).__name__}")
    if not name:
        raise InvalidCheckpointNameError(name, "it is empty")
    if "/" in name or "\\" in name:
        raise InvalidCheckpointNameError(name, "it contains a path separator")
    if ".." in name:
        raise InvalidCheckpointNameError(name, "it contains '..'")
    if name.startswith("."):
        raise InvalidCheckpointNameError(name, "it starts with a dot (reserved for partials)")
    if name == LATEST:
        raise InvalidCheckpointNameError(name, "'latest' is reserved for the newest checkpoint")
    if name == ATTEMPTS_DIR:
        raise InvalidCheckpointNameError(name, f"{ATTEMPTS_DIR!r} is reserved for fencing records")
    if len(name) > _MAX_NAME_LEN:
        raise InvalidCheckpointNameError(name, f"it is longer than {_MAX_NAME_LEN} characters")
    if not _ALLOWED.match(name):
        raise InvalidCheckpointNameError(name, "only letters, digits and _.=+- are allowed")
    return name


def new_save_id() -> str:
    """A fresh identifier for one save attempt (32 hex digits)."""
    return uuid.uuid4().hex


def partial_dir_name(name: str, save_id: str) -> str:
    """The hidden directory a save works in on storage that can rename atomically."""
    return f".{name}{PARTIAL_INFIX}{save_id}"


def is_partial_entry(entry: str) -> bool:
    """True for a hidden partial directory left by a save in progress or an abandoned one."""
    return entry.startswith(".") and PARTIAL_INFIX in entry


def rank_manifest_name(rank: int) -> str:
    """Path of a rank's manifest, relative to the checkpoint directory."""
    return f"{RANKS_DIR}/rank_{rank:05d}.json"


def shard_file_name(rank: int, index: int) -> str:
    """DCP's own shard naming (``__<rank>_<n>.distcp``), so torch's readers find nothing odd."""
    return f"__{rank}_{index}{SHARD_SUFFIX}"


_MEMBER_SEGMENT = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.=+-]*$")


def is_member_path(rel: object) -> bool:
    """Whether ``rel`` can name a file inside a checkpoint: ``.metadata``, ``__0_0.distcp``,
    ``_ranks/rank_00000.json``. At most one folder deep, no ``.``/``..`` segment, no absolute
    path: a manifest that names anything else is refused, so nothing it lists can lead a
    reader, the verifier or replication outside the checkpoint."""
    if not isinstance(rel, str) or not 0 < len(rel) <= 255:
        return False
    parts = rel.split("/")
    return len(parts) <= 2 and all(
        p not in (".", "..") and _MEMBER_SEGMENT.match(p) is not None for p in parts
    )
