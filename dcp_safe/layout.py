"""Every name dcp_safe gives things on storage, defined once, so that no other module spells one.

The commit rule: docs/architecture.md, "The rule"; the layout: "On-storage layout". A debris
object (:func:`is_debris`: lease, takeover record, failure and skip markers) is named after the
save it belongs to, so that one save's marker never speaks for another.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable

from dcp_safe.errors import ConfigError, InvalidCheckpointNameError

COMMITTED_MARKER = "_COMMITTED"
#: ``<name>/_TRASHED``: retention moved the checkpoint to the trash (dcp_safe.retention.trash);
#: it holds the manifest's digest, and its age is the trash's clock.
TRASH_MARKER = "_TRASHED"
#: ``.<name>.trash-<save id>``: a trashed checkpoint on a root that renames.
TRASH_INFIX = ".trash-"
WRITING_LEASE = "_WRITING"
MANIFEST = "manifest.json"
SIGNATURE = "_SIGNATURE"  # signed checkpoints only: dcp_safe.manifest.signing
DCP_METADATA = ".metadata"
RANKS_DIR = "_ranks"
ATTEMPTS_DIR = "_ATTEMPTS"
SHARD_SUFFIX = ".distcp"
PARTIAL_INFIX = ".partial-"
#: ``<name>/_TAKEOVER-<save id>``: who is taking over the lease of save ``<save id>``.
TAKEOVER_PREFIX = "_TAKEOVER-"
#: ``<work>/_FAILED-<save id>``: rank 0's commit of a per-rank upload failed.
COMMIT_FAILED_PREFIX = "_FAILED-"
# ``<work>/_ranks/rank_R.failed-<save id>`` and ``.skipped-<save id>``: rank R's part of a
# per-rank upload failed, or was dropped for a newer save.
_RANK_FAILED_INFIX = ".failed-"
_RANK_SKIPPED_INFIX = ".skipped-"
# ``<work>/_ranks/rank_R.report-<save id>``: rank R's part of a save without collectives is on
# storage; what rank 0 needs of it to publish (adapters.without_collectives). Removed before
# publish.
_RANK_REPORT_INFIX = ".report-"
#: ``.<name>.assigned-<key>`` beside the checkpoints: rank 0's save id for a save without
#: collectives, where the other ranks find it (dcp_safe.adapters.without_collectives).
ASSIGNMENT_INFIX = ".assigned-"
LATEST = "latest"
#: the key of DCP's ``Metadata.planner_data`` under which a save records its tensors'
#: fingerprints for audited restores (dcp_safe.reading.audit).
AUDIT_KEY = "__dcp_safe_audit__"
#: ``<key>@rank00003``: a per-rank entry's key in DCP's metadata (dcp_safe.adapters.planners).
PER_RANK_INFIX = "@rank"
_PER_RANK_KEY = re.compile(rf"^(?P<base>.+){re.escape(PER_RANK_INFIX)}(?P<rank>[0-9]{{5,}})$")
#: the object a root's first exclusive create probes the server with (see FsspecBackend).
PROBE_PREFIX = ".dcp-safe-probe-"
#: ``<root>/_history.jsonl``: the manager's event log (dcp_safe.checkpoints.history).
HISTORY_FILE = "_history.jsonl"
#: ``<node root>/<name>/_NODE_COMMITTED``: a node cache's marker (dcp_safe.checkpoints.node_cache).
NODE_COMMITTED_MARKER = "_NODE_COMMITTED"
#: ``<node root>/.peers/<name>/from_node_00001/``: another node's files, copied here (the peer tier,
#: dcp_safe.checkpoints.node_cache); ``_PEER_COMMITTED`` in it, written last, holds the
#: manifest's digest. Hidden, so nothing that lists a node root's caches sees it.
PEERS_DIR = ".peers"
PEER_COMMITTED_MARKER = "_PEER_COMMITTED"
_PEER_NODE_PREFIX = "from_node_"
_PEER_RESTORE_PREFIX = ".restore-"
#: ``.<file>.tmp-<hex>`` beside ``<file>``: a backend's write before its rename into place.
TEMP_INFIX = ".tmp-"
# ``_ranks/rank_00003.json`` and the markers beside it; ``_ATTEMPTS/<run>/attempt_000000002``.
_RANK_PREFIX = "rank_"
_ATTEMPT_PREFIX = "attempt_"
# An export's folder (dcp_safe.exporting): ``.<dest>.export-<hex>`` beside it until published,
# then ``model.safetensors`` (or Hugging Face's shards and index) or ``model.pt``, and checksums.
EXPORT_INFIX = ".export-"
EXPORT_CHECKSUMS = "SHA256SUMS"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "model.pt"

_MAX_NAME_LEN = 200
_ALLOWED = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]*$")
_SAVE_ID = r"[0-9a-f]{32}"
_PARTIAL = re.compile(rf"^\.(?P<name>.+){re.escape(PARTIAL_INFIX)}{_SAVE_ID}$")
_TRASHED = re.compile(rf"^\.(?P<name>.+){re.escape(TRASH_INFIX)}{_SAVE_ID}$")
_ID = r"[A-Za-z0-9_-]{1,64}"  # a save id as a file name may carry it
_LEASE_ID = re.compile(rf"^{_ID}$")
# What follows ``_ranks/`` in a rank's manifest and markers: its rank, in five digits or more.
_RANK_MEMBER = rf"{RANKS_DIR}/{re.escape(_RANK_PREFIX)}(?P<rank>[0-9]{{5,}})"
_RANK_MANIFEST = re.compile(rf"{_RANK_MEMBER}\.json")
_OWN_FILE = re.compile(rf"^(__[0-9]+_[0-9]+{re.escape(SHARD_SUFFIX)}|{_RANK_MANIFEST.pattern})$")
_RANK_MARKER = re.compile(
    rf"{_RANK_MEMBER}(?:{re.escape(_RANK_FAILED_INFIX)}|{re.escape(_RANK_SKIPPED_INFIX)}"
    rf"|{re.escape(_RANK_REPORT_INFIX)}){_ID}"
)
_ATTEMPT_RECORD = re.compile(rf"{re.escape(_ATTEMPT_PREFIX)}(?P<number>[0-9]{{9}})")
_UNSAFE_IN_RUN_ID = re.compile(r"[^A-Za-z0-9_.=+-]")
_SAVE_MARKER = re.compile(
    rf"(?:{re.escape(TAKEOVER_PREFIX)}|{re.escape(COMMIT_FAILED_PREFIX)}){_ID}"
)


def validate_name(name: object) -> str:
    """Return ``name`` if it is a safe checkpoint name, else raise.

    Raises:
        InvalidCheckpointNameError: empty, with a path separator, ``..``, a leading dot, the
            reserved words ``latest`` and ``_ATTEMPTS``, or characters outside
            ``[A-Za-z0-9_.=+-]``.
    """
    reason = _refusal(name)
    if reason is not None:
        raise InvalidCheckpointNameError(name, reason)
    return str(name)  # a str: _refusal checked


def _refusal(name: object) -> str | None:
    """Why ``name`` is no checkpoint name (the first reason that applies), or None."""
    if not isinstance(name, str):
        return f"expected a str, got {type(name).__name__}"
    reasons = (
        (not name, "it is empty"),
        ("/" in name or "\\" in name, "it contains a path separator"),
        (".." in name, "it contains '..'"),
        (name.startswith("."), "it starts with a dot (reserved for partials)"),
        (name == LATEST, "'latest' is reserved for the newest checkpoint"),
        (name == ATTEMPTS_DIR, f"{ATTEMPTS_DIR!r} is reserved for fencing records"),
        (len(name) > _MAX_NAME_LEN, f"it is longer than {_MAX_NAME_LEN} characters"),
        # fullmatch: `$` alone would pass a trailing newline
        (not _ALLOWED.fullmatch(name), "only letters, digits and _.=+- are allowed"),
    )
    return next((reason for refused, reason in reasons if refused), None)


def format_name(name_format: str, step: int) -> str:
    """The checkpoint name ``name_format`` gives ``step`` (``str.format`` with ``{step}``).

    Raises:
        ConfigError: a pattern ``str.format`` rejects, or a name :func:`validate_name` does.
    """
    try:
        name = name_format.format(step=step)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"bad name_format {name_format!r}: {exc}") from None
    return validate_name(name)


def new_save_id() -> str:
    return uuid.uuid4().hex


def peer_copy_dir(name: str, node: int) -> str:
    """``.peers/<name>/from_node_NNNNN``: node ``node``'s files of ``name``, held elsewhere."""
    return f"{PEERS_DIR}/{name}/{_PEER_NODE_PREFIX}{node:05d}"


def peer_partial_dir(name: str, node: int, save_id: str) -> str:
    """Where a peer copy lands before it is committed (renamed to :func:`peer_copy_dir`)."""
    return f"{PEERS_DIR}/{name}/.{_PEER_NODE_PREFIX}{node:05d}{PARTIAL_INFIX}{save_id}"


def peer_node_of(entry: str) -> int | None:
    """The node of a committed peer copy's folder name (``from_node_00001`` -> 1), else ``None``."""
    digits = entry.removeprefix(_PEER_NODE_PREFIX)
    return int(digits) if digits != entry and len(digits) >= 5 and digits.isdigit() else None


def peer_restore_dir(token: str) -> str:
    """Files a restore fetched from peers, removed after it."""
    return f"{PEERS_DIR}/{_PEER_RESTORE_PREFIX}{token}"


def partial_dir_name(name: str, save_id: str) -> str:
    """Where a save works on storage that can rename atomically."""
    return f".{name}{PARTIAL_INFIX}{save_id}"


def trash_dir_name(name: str) -> str:
    """A fresh hidden folder for checkpoint ``name`` in the trash (a root that renames)."""
    return f".{name}{TRASH_INFIX}{new_save_id()}"


def trashed_name(entry: str) -> str | None:
    """The checkpoint name of a trash folder (:func:`trash_dir_name`), else ``None``."""
    match = _TRASHED.match(entry)
    return match["name"] if match is not None and is_valid_name(match["name"]) else None


def is_partial_entry(entry: str) -> bool:
    """True for a hidden partial directory left by a save in progress or an abandoned one.

    Strictly ``.<valid name>.partial-<save id>`` with a save id as :func:`new_save_id` makes
    them: a user's ``.notes.partial-draft`` is not one, and the sweeper leaves it alone.
    """
    match = _PARTIAL.match(entry)
    return match is not None and is_valid_name(match["name"])


def lease_file_name(save_id: str | None = None) -> str:
    """The writing lease under ``<name>/``: ``_WRITING`` where it is taken by an exclusive
    create, ``_WRITING-<save id>`` (one per save) where storage has none (see commit.lease)."""
    return WRITING_LEASE if save_id is None else f"{WRITING_LEASE}-{_checked_id(save_id)}"


def is_lease_file(entry: str) -> bool:
    """True for either form of :func:`lease_file_name`."""
    head, dash, save_id = entry.partition("-")
    return head == WRITING_LEASE and (not dash or is_save_id(save_id))


def is_save_id(value: object) -> bool:
    """Whether ``value`` is a save id as a file name may carry it (``[A-Za-z0-9_-]``, 1 to 64
    characters): what a lease read from storage must hold before its id is used or shown."""
    return isinstance(value, str) and _LEASE_ID.fullmatch(value) is not None


def takeover_record_name(save_id: str) -> str:
    return f"{TAKEOVER_PREFIX}{_checked_id(save_id)}"


# The markers and reports of save ``save_id``, relative to its work folder (spelled above).
def commit_failure_marker_name(save_id: str) -> str:
    return f"{COMMIT_FAILED_PREFIX}{_checked_id(save_id)}"


def rank_failure_marker_name(rank: int, save_id: str) -> str:
    return f"{_rank_stem(rank)}{_RANK_FAILED_INFIX}{_checked_id(save_id)}"


def rank_skip_marker_name(rank: int, save_id: str) -> str:
    return f"{_rank_stem(rank)}{_RANK_SKIPPED_INFIX}{_checked_id(save_id)}"


def rank_report_name(rank: int, save_id: str) -> str:
    return f"{_rank_stem(rank)}{_RANK_REPORT_INFIX}{_checked_id(save_id)}"


def assignment_file_name(name: str, key: str) -> str:
    """Where rank 0 of a save of ``name`` without collectives tells the other ranks its save
    id, relative to the root; ``key`` (made safe here) is what every rank of that save knows."""
    return f".{validate_name(name)}{ASSIGNMENT_INFIX}{_UNSAFE_IN_RUN_ID.sub('_', key)[:100]}"


def rank_of_marker(member: str) -> int | None:
    """The rank a failure or skip marker (as :func:`rank_failure_marker_name` spells it, or its
    last path segment) names; None for anything else."""
    return _rank_in(_RANK_MARKER, member)


def is_debris(member: str) -> bool:
    """Whether ``member`` (relative to ``<name>/``) is an object dcp_safe writes there that is
    never part of a checkpoint: a lease, a takeover record, or a failure or skip marker."""
    return (
        ("/" not in member and is_lease_file(member))
        or _SAVE_MARKER.fullmatch(member) is not None
        or _RANK_MARKER.fullmatch(member) is not None
    )


def is_own_object(rel: str) -> bool:
    """Whether ``rel`` (relative to a root) names a file dcp_safe writes for checkpoint
    ``<name>``: ``<valid name>/`` then a shard, ``.metadata``, ``manifest.json``, a rank
    manifest, the marker, or debris (:func:`is_debris`). The sweeper touches nothing else
    (another application's multipart upload under the same prefix, say)."""
    name, _, member = rel.partition("/")
    return is_valid_name(name) and (
        member in (DCP_METADATA, MANIFEST, COMMITTED_MARKER, SIGNATURE)
        or is_debris(member)
        or _OWN_FILE.match(member) is not None
    )


def _checked_id(save_id: str) -> str:
    if not is_save_id(save_id):
        raise ValueError(f"a save id must match {_LEASE_ID.pattern}, got {save_id!r}")
    return save_id


def is_valid_name(name: object) -> bool:
    """Whether :func:`validate_name` accepts ``name`` (a listed entry may be a checkpoint)."""
    return _refusal(name) is None


def rank_manifest_name(rank: int) -> str:
    return f"{_rank_stem(rank)}.json"


def rank_of_manifest(member: str) -> int | None:
    """The rank whose manifest ``member`` is, as :func:`rank_manifest_name` spells it (or its
    last path segment, as a listing of ``_ranks/`` gives it); None for anything else."""
    return _rank_in(_RANK_MANIFEST, member)


def _rank_in(pattern: re.Pattern[str], member: str) -> int | None:
    match = pattern.fullmatch(member if "/" in member else f"{RANKS_DIR}/{member}")
    return None if match is None else int(match["rank"])


def _rank_stem(rank: int) -> str:
    return f"{RANKS_DIR}/{_RANK_PREFIX}{rank:05d}"


def attempts_dir(run_id: str) -> str:
    """``_ATTEMPTS/<run id>``: where one run's attempts are recorded, relative to the root. The
    run id is kept one safe path component (at most 100 characters) whatever it was given."""
    return f"{ATTEMPTS_DIR}/{_UNSAFE_IN_RUN_ID.sub('_', run_id)[:100]}"


def attempt_record_name(number: int) -> str:
    return f"{_ATTEMPT_PREFIX}{number:09d}"


def attempt_of_record(entry: str) -> int | None:
    match = _ATTEMPT_RECORD.fullmatch(entry)
    return None if match is None else int(match["number"])


def temp_file_name(leaf: str) -> str:
    return f".{leaf}{TEMP_INFIX}{uuid.uuid4().hex}"


def export_work_dir_name(leaf: str, token: str) -> str:
    return f".{leaf}{EXPORT_INFIX}{token}"


def safetensors_shard_name(index: int, count: int) -> str:
    """Hugging Face's name for shard ``index`` (from 1) of ``count``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def per_rank_key(key: str, rank: int) -> str:
    return f"{key}{PER_RANK_INFIX}{rank:05d}"


def per_rank_base(stored: str) -> str | None:
    """The state dict key a per-rank entry's stored key belongs to (``None``: not one)."""
    found = _PER_RANK_KEY.match(stored)
    return None if found is None else found["base"]


def per_rank_ranks(key: str, stored: Iterable[str]) -> set[int]:
    """The ranks that saved their own value of ``key`` among the ``stored`` keys."""
    found = map(_PER_RANK_KEY.match, stored)
    return {int(m["rank"]) for m in found if m is not None and m["base"] == key}


def shard_file_name(rank: int, index: int) -> str:
    """DCP's own shard naming (``__<rank>_<n>.distcp``), so torch's readers find nothing odd."""
    return f"__{rank}_{index}{SHARD_SUFFIX}"


_SHARD = re.compile(rf"__(?P<rank>[0-9]{{1,7}})_[0-9]+{re.escape(SHARD_SUFFIX)}")


def rank_of_shard(rel: str) -> int | None:
    """The rank in a shard file's name (:func:`shard_file_name`), or ``None``."""
    match = _SHARD.fullmatch(rel)
    return None if match is None else int(match["rank"])


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
