"""Versioned manifests: per-rank and global, as frozen dataclasses <-> canonical JSON.

The global ``manifest.json`` lists every file of a checkpoint with its size, and every item
(a tensor chunk or a serialized object) with its byte range and checksum. Shard files are
covered by their items, byte for byte: a file whose items do not tile it exactly is corrupt, so a
flipped byte anywhere in a shard lands in some item's checksum. Small files (``.metadata``, rank
manifests) carry a whole-file checksum instead.

JSON is canonical (sorted keys, no spaces) so the digest in ``_COMMITTED`` is reproducible.
Reading is strict (:mod:`dcp_safe.manifest.limits`): every field is checked for its type and
range, checksums must name a known algorithm, and paths must be the checkpoint's own members;
anything else is a :class:`~dcp_safe.errors.CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dcp_safe import layout
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.checksum import parse_checksum
from dcp_safe.manifest.limits import parse_json, require_int, require_str, require_timestamp

__all__ = [
    "MANIFEST_VERSION",
    "FileRecord",
    "ItemKey",
    "ItemRecord",
    "Manifest",
    "RankManifest",
    "item_key",
    "manifest_digest",
]

MANIFEST_VERSION = 1

ItemKey = tuple[str, tuple[int, ...] | None]
"""How an item is looked up: DCP's ``MetadataIndex`` without its non-identifying hint."""


def item_key(fqn: str, offset: Iterable[int] | None) -> ItemKey:
    """The lookup key of a ``MetadataIndex(fqn, offset)``."""
    return (fqn, None if offset is None else tuple(int(o) for o in offset))


@dataclass(frozen=True, kw_only=True)
class ItemRecord:
    """One write item: where its bytes are and what they hash to."""

    fqn: str
    offset: tuple[int, ...] | None
    file: str
    start: int
    length: int
    checksum: str
    transforms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not layout.is_member_path(self.file):
            raise ValueError(f"item file {self.file!r} is not a file of the checkpoint")
        _require_size("start", self.start)
        _require_size("length", self.length)
        require_str("fqn", self.fqn)
        if self.offset is not None:
            for index in self.offset:
                require_int("offset", index)
        _require_checksum(self.checksum)
        for transform in self.transforms:
            require_str("transform", transform, max_length=64)

    @property
    def key(self) -> ItemKey:
        return (self.fqn, self.offset)

    def describe(self) -> str:
        return self.fqn if self.offset is None else f"{self.fqn}@{list(self.offset)}"


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """One file of a checkpoint. ``checksum`` is None for shard files (their items cover them)."""

    path: str
    size: int
    checksum: str | None = None

    def __post_init__(self) -> None:
        if not layout.is_member_path(self.path):
            raise ValueError(f"file path {self.path!r} is not a file of the checkpoint")
        _require_size("size", self.size)
        if self.checksum is not None:
            _require_checksum(self.checksum)


def _require_size(field: str, value: object) -> None:
    require_int(field, value, what="a byte count")


def _require_checksum(value: object) -> None:
    """``"<known algorithm>:<digest>"``; an unknown algorithm (``md5:``) is corrupt."""
    checksum = require_str("checksum", value, max_length=512)
    _, digest = parse_checksum(checksum)  # ValueError on an unknown algorithm
    if not digest:
        raise ValueError(f"checksum {checksum!r} has no digest")


def _require_common(manifest: RankManifest | Manifest) -> None:
    """The fields both kinds of manifest share."""
    require_str("name", manifest.name, max_length=255)
    require_str("save_id", manifest.save_id, max_length=255)
    parse_checksum(require_str("checksum_algorithm", manifest.checksum_algorithm) + ":")
    require_int("version", manifest.version)


@dataclass(frozen=True, kw_only=True)
class RankManifest:
    """What one rank wrote, written by that rank after its files are durable."""

    name: str
    save_id: str
    rank: int
    checksum_algorithm: str
    files: tuple[FileRecord, ...]
    items: tuple[ItemRecord, ...]
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        _require_common(self)
        require_int("rank", self.rank)

    def to_json(self) -> bytes:
        return _dumps(_tagged(self, "dcp_safe/rank-manifest"))

    @classmethod
    def from_json(cls, data: bytes, path: str) -> RankManifest:
        return _build(cls, _loads(data, path, "dcp_safe/rank-manifest"), path)


@dataclass(frozen=True, kw_only=True)
class Manifest:
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
    # The job attempt that wrote it (dcp_safe.commit.fencing); None when not fenced, and in
    # manifests written before fencing existed.
    attempt: int | None = None
    version: int = MANIFEST_VERSION
    _by_key: Mapping[ItemKey, ItemRecord] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require_common(self)
        require_int("world_size", self.world_size, minimum=1)
        require_timestamp("created_at", self.created_at)
        require_str("compression", self.compression, max_length=64)
        require_str("dcp_safe_version", self.dcp_safe_version, max_length=255)
        require_str("torch_version", self.torch_version, max_length=255)
        if self.step is not None:
            require_int("step", self.step)
        if self.attempt is not None:
            require_int("attempt", self.attempt)
        object.__setattr__(self, "_by_key", {item.key: item for item in self.items})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def item(self, key: ItemKey) -> ItemRecord | None:
        return self._by_key.get(key)

    def file(self, path: str) -> FileRecord | None:
        return next((f for f in self.files if f.path == path), None)

    def to_json(self) -> bytes:
        return _dumps(_tagged(self, "dcp_safe/manifest"))

    @classmethod
    def from_json(cls, data: bytes, path: str) -> Manifest:
        return _build(cls, _loads(data, path, "dcp_safe/manifest"), path)


def manifest_digest(data: bytes) -> str:
    """The digest ``_COMMITTED`` holds: sha256 of the manifest's exact bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tagged(obj: Any, kind: str) -> dict[str, Any]:
    raw = {
        f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")
    }
    raw["files"] = [dataclasses.asdict(f) for f in obj.files]
    raw["items"] = [_item_to_dict(i) for i in obj.items]
    raw["format"] = kind
    return raw


def _item_to_dict(item: ItemRecord) -> dict[str, Any]:
    raw = dataclasses.asdict(item)
    raw["offset"] = None if item.offset is None else list(item.offset)
    raw["transforms"] = list(item.transforms)
    return raw


def _dumps(raw: Mapping[str, Any]) -> bytes:
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


def _loads(data: bytes, path: str, kind: str) -> dict[str, Any]:
    raw = parse_json(data, path)
    if not isinstance(raw, dict) or raw.get("format") != kind:
        raise CheckpointCorruptError(path, f"not a {kind} document")
    if raw.get("version") != MANIFEST_VERSION:
        raise CheckpointCorruptError(
            path,
            "unsupported manifest version",
            expected=MANIFEST_VERSION,
            actual=raw.get("version"),
        )
    del raw["format"]
    return raw


T = TypeVar("T")


def _build(cls: type[T], raw: dict[str, Any], path: str) -> T:
    try:
        return cls(**_with_records(raw))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"malformed manifest ({exc})") from exc


def _with_records(raw: dict[str, Any]) -> dict[str, Any]:
    raw["files"] = tuple(FileRecord(**f) for f in _records("files", raw["files"]))
    raw["items"] = tuple(
        ItemRecord(
            **{
                **i,
                "offset": None if i["offset"] is None else tuple(_list("offset", i["offset"])),
                "transforms": tuple(_list("transforms", i["transforms"])),
            }
        )
        for i in _records("items", raw["items"])
    )
    return raw


def _records(field: str, value: object) -> list[dict[str, Any]]:
    """A JSON list of objects (a string or a mapping would iterate as something else)."""
    records = _list(field, value)
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{field} must be a list of objects")
    return records


def _list(field: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a list, got {type(value).__name__}")
    return value
