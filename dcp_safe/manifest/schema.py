"""Versioned manifests: per-rank and global, as frozen dataclasses <-> canonical JSON.

What a manifest covers: docs/architecture.md, "The rule". JSON is canonical (sorted keys, no
spaces) so the digest in ``_COMMITTED`` is reproducible. Reading is strict: every field typed and
ranged, known checksum algorithms, the checkpoint's own paths; anything else is a
:class:`~dcp_safe.errors.CheckpointCorruptError` naming the file.

Written by one ``json.dumps`` whose hook turns each record into its ``to_dict``, not by
``dataclasses.asdict`` (0.66 s for 8,192 items, a third of a 4,096-tensor commit); per-item
checks take a fast path for the common valid case.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

from dcp_safe import layout
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.blocks import BlockDigests
from dcp_safe.manifest.checksum import ChecksumAlgorithm, parse_checksum
from dcp_safe.manifest.limits import (
    MAX_INT,
    MAX_STR,
    parse_json,
    require_int,
    require_keys,
    require_list,
    require_str,
    require_timestamp,
)

MANIFEST_VERSION = 1

ItemKey = tuple[str, tuple[int, ...] | None]
"""How an item is looked up: DCP's ``MetadataIndex`` without its non-identifying hint."""


def item_key(fqn: str, offset: Iterable[int] | None) -> ItemKey:
    """The lookup key of a ``MetadataIndex(fqn, offset)``."""
    return (fqn, None if offset is None else tuple(int(o) for o in offset))


@dataclass(frozen=True, kw_only=True)
class ItemRecord:
    """One write item: where its bytes are and what they hash to.

    ``blocks``: digests of the item's tensor data block by block, for reads of part of it
    (:mod:`dcp_safe.manifest.blocks`); ``None`` for small, compressed and non-tensor items and
    in manifests written before them (then left out of the JSON).
    """

    fqn: str
    offset: tuple[int, ...] | None
    file: str
    start: int
    length: int
    checksum: str
    transforms: tuple[str, ...] = ()
    blocks: BlockDigests | None = None

    def __post_init__(self) -> None:
        if _plainly_valid(vars(self)):
            return
        if not _is_member(self.file):
            raise ValueError(f"item file {self.file!r} is not a file of the checkpoint")
        require_int("start", self.start, what="a byte count")
        require_int("length", self.length, what="a byte count")
        require_str("fqn", self.fqn)
        for index in self.offset or ():
            require_int("offset", index)
        _require_checksum(self.checksum)
        for transform in self.transforms:
            require_str("transform", transform, max_length=_MAX_TRANSFORM_CHARS)

    @property
    def key(self) -> ItemKey:
        return (self.fqn, self.offset)

    def to_dict(self) -> dict[str, Any]:
        """The record's JSON object (``blocks`` left out when None, as before block digests)."""
        plain = dict(vars(self))  # the fields (``blocks`` only where set: the fast path)
        if (blocks := plain.pop("blocks", None)) is not None:
            plain["blocks"] = blocks.to_dict()
        return plain

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ItemRecord:
        """The record a :meth:`to_dict` object describes; every key present, no other key.

        Raises:
            ValueError: a missing or unknown key, or a field of the wrong type or range.
        """
        if raw.keys() == _ITEM_KEYS and _plainly_valid(raw):  # built without the dataclass init
            record = object.__new__(cls)
            offset = None if raw["offset"] is None else tuple(raw["offset"])
            record.__dict__.update(raw, offset=offset, transforms=tuple(raw["transforms"]))
            return record
        fields = dict(require_keys("item record", raw, _ITEM_KEYS | {"blocks"}, _BLOCKS))
        fields["transforms"] = tuple(require_list("transforms", raw["transforms"]))
        if raw["offset"] is not None:
            fields["offset"] = tuple(require_list("offset", raw["offset"]))
        if raw.get("blocks") is not None:
            fields["blocks"] = BlockDigests.from_dict(raw["blocks"])
        return cls(**fields)

    def describe(self) -> str:
        return self.fqn if self.offset is None else f"{self.fqn}@{list(self.offset)}"


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint. ``checksum`` is None for shard files (their items cover them)."""

    path: str
    size: int
    checksum: str | None = None

    def __post_init__(self) -> None:
        if not _is_member(self.path):
            raise ValueError(f"file path {self.path!r} is not a file of the checkpoint")
        require_int("size", self.size, what="a byte count")
        if self.checksum is not None:
            _require_checksum(self.checksum)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> FileRecord:
        """The record a :meth:`to_dict` object describes (``checksum`` may be left out).

        Raises:
            ValueError: a missing or unknown key, or a field of the wrong type or range.
        """
        return cls(**require_keys("file record", raw, _FILE_KEYS, frozenset({"checksum"})))


_ITEM_KEYS = frozenset(("fqn", "offset", "file", "start", "length", "checksum", "transforms"))
_FILE_KEYS = frozenset(("path", "size", "checksum"))
_BLOCKS = frozenset({"blocks"})
_KNOWN_ALGORITHMS = frozenset(a.value for a in ChecksumAlgorithm)
_MAX_CHECKSUM_CHARS = 512
_MAX_TRANSFORM_CHARS = 64
_SEQUENCES = (list, tuple)


# A save names few distinct files across thousands of items: each name is checked once.
_is_member_name = functools.lru_cache(maxsize=4096)(layout.is_member_path)


def _is_member(path: object) -> bool:
    return _is_member_name(path) if type(path) is str else layout.is_member_path(path)


def _is_count(value: object) -> bool:
    """The common case of :func:`require_int`, without its call and message (bool excluded)."""
    return type(value) is int and 0 <= value <= MAX_INT


def _is_checksum(value: object) -> bool:
    """The common case of :func:`_require_checksum`, without its messages."""
    if type(value) is str and len(value) <= _MAX_CHECKSUM_CHARS:
        algorithm, _, digest = value.partition(":")
        return bool(digest) and algorithm in _KNOWN_ALGORITHMS
    return False


def _plainly_valid(fields: Mapping[str, Any]) -> bool:
    """Whether an item's fields (a record's, or its JSON object's) are valid in their common
    form (exact types), checked with no call or message per field: loads check millions."""
    offset, transforms, fqn = fields["offset"], fields["transforms"], fields["fqn"]
    return (
        type(fqn) is str
        and len(fqn) <= MAX_STR
        and _is_count(fields["start"])
        and _is_count(fields["length"])
        and _is_checksum(fields["checksum"])
        and _is_member(fields["file"])
        and (offset is None or (type(offset) in _SEQUENCES and all(map(_is_count, offset))))
        and type(transforms) in _SEQUENCES
        and all(type(t) is str and len(t) <= _MAX_TRANSFORM_CHARS for t in transforms)
    )


def _require_checksum(value: object) -> None:
    """``"<known algorithm>:<digest>"``; an unknown algorithm (``md5:``) is corrupt."""
    if _is_checksum(value):
        return
    checksum = require_str("checksum", value, max_length=_MAX_CHECKSUM_CHARS)
    _, digest = parse_checksum(checksum)  # ValueError on an unknown algorithm
    if not digest:
        raise ValueError(f"checksum {checksum!r} has no digest")


# The longest a document's string fields may be (characters), where not 255.
_MAX_CHARS = {"compression": 64, "data_format": 64}


class _Document:
    """What both kinds of manifest share: canonical JSON out, strict JSON in."""

    _FORMAT: ClassVar[str]
    checksum_algorithm: str
    files: tuple[FileRecord, ...]
    items: tuple[ItemRecord, ...]

    def __post_init__(self) -> None:
        """Each field checked by its annotation (an optional one only when set); the records
        were checked when they were made."""
        for f in fields(self):  # type: ignore[arg-type]
            value, kind = getattr(self, f.name), str(f.type)
            if value is None and kind.endswith(" | None"):
                continue
            kind = kind.removesuffix(" | None")
            if kind == "str":
                require_str(f.name, value, max_length=_MAX_CHARS.get(f.name, 255))
            elif kind == "int":
                require_int(f.name, value, minimum=int(f.name == "world_size"))
            elif kind == "float":
                require_timestamp(f.name, value)
            elif kind.startswith("Mapping") and not isinstance(value, dict):
                raise ValueError(f"{f.name} must be an object")
        parse_checksum(self.checksum_algorithm + ":")  # ValueError on an unknown algorithm

    def to_dict(self) -> dict[str, Any]:
        """The document's JSON object, its records as records (:meth:`to_json` writes them);
        ``dcp_metadata``, ``data_format`` and ``metrics`` left out when None, so such a
        manifest is byte for byte what older versions wrote."""
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name[0] != "_"}  # type: ignore[arg-type]
        dropped = [k for k in ("dcp_metadata", "data_format", "metrics") if plain.get(k, 0) is None]
        return {k: v for k, v in plain.items() if k not in dropped} | {"format": self._FORMAT}

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, ASCII), records as their ``to_dict``."""
        records = operator.methodcaller("to_dict")
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), default=records
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, path: str) -> Self:
        """Raises CheckpointCorruptError: not such a document, of this version, well formed."""
        raw = parse_json(data, path)
        if not isinstance(raw, dict) or raw.get("format") != cls._FORMAT:
            raise CheckpointCorruptError(path, f"not a {cls._FORMAT} document")
        if raw.get("version") != MANIFEST_VERSION:
            raise CheckpointCorruptError(
                path,
                "unsupported manifest version",
                expected=MANIFEST_VERSION,
                actual=raw.get("version"),
            )
        del raw["format"]
        private = sorted(key for key in raw if key.startswith("_"))
        if private:  # the lookup tables are derived, never read from storage
            raise CheckpointCorruptError(path, f"malformed manifest (unknown fields {private})")
        try:
            raw["files"] = tuple(FileRecord.from_dict(f) for f in _records("files", raw["files"]))
            raw["items"] = tuple(ItemRecord.from_dict(i) for i in _records("items", raw["items"]))
            return cls(**raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(path, f"malformed manifest ({exc})") from exc


@dataclass(frozen=True, kw_only=True)
class RankManifest(_Document):
    """What one rank wrote, written by that rank after its files are durable."""

    name: str
    save_id: str
    rank: int
    checksum_algorithm: str
    files: tuple[FileRecord, ...]
    items: tuple[ItemRecord, ...]
    version: int = MANIFEST_VERSION
    _FORMAT = "dcp_safe/rank-manifest"


@dataclass(frozen=True, kw_only=True)
class Manifest(_Document):
    """The global manifest, written by the coordinator at publish."""

    name: str
    save_id: str
    world_size: int
    created_at: float
    checksum_algorithm: str
    compression: str
    files: tuple[FileRecord, ...]
    items: tuple[ItemRecord, ...]
    dcp_safe_version: str
    torch_version: str
    step: int | None = None
    # The job attempt that wrote it (dcp_safe.commit.fencing); None when not fenced.
    attempt: int | None = None
    # DCP's metadata as plain JSON (dcp_safe.manifest.dcp_metadata), checked by its decoder;
    # None in older manifests (and then left out of the JSON).
    dcp_metadata: Mapping[str, Any] | None = field(default=None, hash=False, repr=False)
    # What wrote the files when not DCP ("torch_checkpointing": dcp_safe.torch_checkpointing);
    # None (and left out of the JSON) for DCP's own.
    data_format: str | None = None
    # The user's metrics and labels of this save (check_metrics); None (and left out of the
    # JSON) when none were given, and in older manifests. Covered by the digest and signature.
    metrics: Mapping[str, float | str] | None = field(default=None, hash=False)
    version: int = MANIFEST_VERSION
    _by_key: Mapping[ItemKey, ItemRecord] = field(default_factory=dict, repr=False, compare=False)
    _by_path: Mapping[str, FileRecord] = field(default_factory=dict, repr=False, compare=False)
    _FORMAT = "dcp_safe/manifest"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metrics is not None:
            object.__setattr__(self, "metrics", check_metrics(self.metrics))
        object.__setattr__(self, "_by_key", {item.key: item for item in self.items})
        # Reversed: of records of one path, the first wins, as a scan would find it.
        object.__setattr__(self, "_by_path", {r.path: r for r in reversed(self.files)})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def item(self, key: ItemKey) -> ItemRecord | None:
        return self._by_key.get(key)

    def file(self, path: str) -> FileRecord | None:
        return self._by_path.get(path)


Metrics = Mapping[str, float | str]
"""A save's metrics and labels, as :func:`check_metrics` takes them."""
MAX_METRICS = 64
_MAX_METRIC_KEY_CHARS = 64


def check_metrics(metrics: object) -> dict[str, float | str]:
    """``metrics`` as a manifest holds them: at most :data:`MAX_METRICS` entries, each key a
    non-empty printable string of at most 64 characters, each value a finite number (stored as a
    float; retention ranks by these) or a printable string of at most 255 characters (a label: a
    config hash, a data position). Small by design: a manifest is read at every listing.

    Raises:
        ValueError: anything else (``ConfigError`` is one, where a caller passes it in).
    """
    if not isinstance(metrics, Mapping):
        kind = type(metrics).__name__
        raise ValueError(f"metrics must be a mapping of str to number or str, got {kind}")
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"at most {MAX_METRICS} metrics, got {len(metrics)}")
    checked: dict[str, float | str] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not 0 < len(key) <= _MAX_METRIC_KEY_CHARS:
            raise ValueError(f"a metric's name must be 1 to 64 characters, got {key!r:.70}")
        if not key.isprintable() or (isinstance(value, str) and not value.isprintable()):
            raise ValueError(f"metric {key!r}: names and labels must be printable text")
        if isinstance(value, str):
            checked[key] = require_str(f"metric {key!r}", value, max_length=255)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not -1e300 < value < 1e300:  # NaN, an infinity, or a float or int past them
                raise ValueError(f"metric {key!r} must be finite, got {value!r:.40}")
            checked[key] = float(value)
        else:
            raise ValueError(
                f"metric {key!r} must be a number or a str, got {type(value).__name__}"
            )
    return checked


def manifest_digest(data: bytes) -> str:
    """The digest ``_COMMITTED`` holds: sha256 of the manifest's exact bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _records(field: str, value: object) -> list[dict[str, Any]]:
    """A JSON list of objects (a string or a mapping would iterate as something else)."""
    records = require_list(field, value)
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{field} must be a list of objects")
    return records
