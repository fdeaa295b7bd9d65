"""DCP's global metadata as plain JSON in ``manifest.json``: the encoding and its strict decoder.

DCP's ``.metadata`` is a pickle, and a restricted unpickler still leaves its memo, ``BUILD``
(``setattr`` on an admitted class, process-wide) and shared containers that cost hours to walk.
So the coordinator records what a load needs of it as plain values under the manifest's
``dcp_metadata`` field, and :func:`decode_dcp_metadata` rebuilds ``Metadata`` from them, every
field typed, bounded and matched to its manifest item. A trusted ``.metadata``
(``allow_pickle=True``) goes through the same decoder, walked into this form without running it
(:func:`dcp_safe.checkpoints.metadata.decode_pickled_metadata`).

A manifest field, not a file: the marker's digest and a signature cover it with nothing added,
the one read that opens a checkpoint reads it, and it travels wherever the manifest is copied.
Older versions refuse a manifest with it as malformed; one without it is what they wrote.

Format (``"format": "dcp_safe/dcp-metadata"``, ``"version": 1``)::

    {"dcp_version": "1.0.0",
     "entries": [[key, null],                                # an object (BytesStorageMetadata)
                 [key, {"dtype": "float32", "layout": "strided", "memory_format":
                        "contiguous_format", "requires_grad": false, "pin_memory": false,
                        "size": [16, 8], "chunks": [[[0, 0], [16, 8]]]}]],   # offsets, sizes
     "planner_data": null | {"paths": [[key, ["extra", "history", 0]], ...],
                             "audit": null | [[key, "<16 hex digits per block>"], ...]}}

Lists keep DCP's order and carry no duplicate keys to argue about. A tensor's fingerprints
(blocks 0, 1, ... of :mod:`dcp_safe.reading.audit`) are one string of 64-bit big-endian hex numbers
(less text, decoded at C speed). ``storage_data`` is rebuilt from the manifest's items, so a
load reads only bytes the manifest names and checksums; ``storage_meta`` from its name and
save id.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_safe import layout
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.limits import MAX_INT, require_int, require_keys, require_list, require_str
from dcp_safe.manifest.schema import ItemRecord, Manifest
from dcp_safe.torch_compat import StorageInfo

FORMAT = "dcp_safe/dcp-metadata"
VERSION = 1
#: Dimensions of a tensor at most (torch itself allows 64 on CPU).
MAX_DIMS = 64
#: Elements of one flatten path (the keys and indices from the state dict down to a value).
_MAX_PATH = 256
#: Fingerprint blocks per tensor at most (dcp_safe.reading.audit records 16).
_MAX_BLOCKS = 1 << 10
#: How much a zstd frame can expand at most: a 3-byte block header and one byte stand for a
#: 128 KiB block (RLE), 32,768 to 1; with margin. An item that is compressed cannot declare
#: more elements than this many times its stored bytes.
ZSTD_MAX_RATIO = 1 << 16

T = TypeVar("T")


def _torch_names(kind: type[T]) -> dict[str, T]:
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}


_DTYPES = _torch_names(torch.dtype)
_LAYOUTS = _torch_names(torch.layout)
# The memory formats DCP's TensorProperties can pickle at all.
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    name: getattr(torch, name) for name in ("contiguous_format", "channels_last", "preserve_format")
}
_TOP_KEYS = frozenset(("format", "version", "dcp_version", "entries", "planner_data"))
# A tensor entry's properties: those named from a table, and the flags.
_NAMED: dict[str, Mapping[str, Any]] = {
    "dtype": _DTYPES,
    "layout": _LAYOUTS,
    "memory_format": _MEMORY_FORMATS,
}
_FLAGS = ("requires_grad", "pin_memory")
_TENSOR_KEYS = frozenset((*_NAMED, *_FLAGS, "size", "chunks"))
_PLANNER_KEYS = frozenset(("paths", "audit"))


def encode_dcp_metadata(metadata: object) -> dict[str, Any]:
    """The plain form (a manifest's ``dcp_metadata``) of DCP's ``Metadata``, as a save's
    coordinator holds it.

    Raises:
        ValueError: something DCP's own planners never write (a custom planner's data, an
            unknown entry type or field type).
    """
    if not isinstance(metadata, Metadata):
        raise ValueError(f"not DCP metadata ({type(metadata).__name__})")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise ValueError("state_dict_metadata is not a dict")
    version = metadata.version
    if version is not None and not isinstance(version, str):
        raise ValueError("version is not a string")
    return {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": version,
        "entries": _entries(entries),
        "planner_data": _encode_planner(metadata.planner_data),
    }


# The last entries encoded, with their encoding: a save with a cached plan hands over
# the very same ``state_dict_metadata`` (the layout did not change), whose encoding was a fifth
# of a 10,000-tensor save. Nothing in a save changes that dict once planned.
_last_entries: tuple[dict[Any, Any], int, list[list[Any]]] | None = None


def _entries(entries: dict[Any, Any]) -> list[list[Any]]:
    global _last_entries
    last = _last_entries
    if last is not None and last[0] is entries and last[1] == len(entries):
        return list(last[2])
    encoded = [[_str_key(key), _encode_entry(entry)] for key, entry in entries.items()]
    _last_entries = (entries, len(entries), encoded)
    return list(encoded)


_str_key = functools.partial(require_str, "a key")


def _name_of(table: Mapping[str, T], value: object, what: str) -> str:
    for name, known in table.items():
        if known is value:
            return name
    raise ValueError(f"unknown {what} {type(value).__name__}")


def _plain_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} is not a bool")
    return value


def _encode_dims(value: object, what: str, rank: int | None = None) -> list[int]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        raise ValueError(f"{what} is not a sequence of at most {MAX_DIMS} sizes")
    if rank is not None and len(value) != rank:
        raise ValueError(f"{what} has {len(value)} dimensions, its tensor {rank}")
    for size in value:  # the common case inline: tens of thousands of chunks a save
        if type(size) is not int or not 0 <= size <= MAX_INT:
            require_int(what, size)  # raises, with the message
    return list(value)


def _encode_entry(entry: object) -> dict[str, Any] | None:
    if type(entry) is BytesStorageMetadata:
        return None
    if type(entry) is not TensorStorageMetadata:
        raise ValueError(f"unknown entry type {type(entry).__name__}")
    props, chunks = entry.properties, entry.chunks
    if type(props) is not TensorProperties or not isinstance(chunks, list):
        raise ValueError("a tensor entry without properties or chunks")
    if odd := [c for c in chunks if type(c) is not ChunkStorageMetadata][:1]:
        raise ValueError(f"unknown chunk type {type(odd[0]).__name__}")
    return {
        **{key: _name_of(table, getattr(props, key), key) for key, table in _NAMED.items()},
        **{key: _plain_bool(getattr(props, key), key) for key in _FLAGS},
        "size": _encode_dims(entry.size, "size"),
        "chunks": [
            [_encode_dims(c.offsets, "offsets"), _encode_dims(c.sizes, "sizes")] for c in chunks
        ],
    }


def _encode_planner(data: object) -> dict[str, Any] | None:
    """DCP's flatten mappings (key -> path) and dcp_safe's fingerprints (under AUDIT_KEY)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"planner data of type {type(data).__name__} (a custom planner's)")
    paths: list[list[Any]] = []
    audit: list[list[Any]] | None = None
    for key, value in data.items():
        if key == layout.AUDIT_KEY:
            audit = encode_audit(value)
            continue
        if not isinstance(value, (tuple, list)) or not 0 < len(value) <= _MAX_PATH:
            raise ValueError("planner data that is not a flatten path")
        paths.append([_str_key(key), [_path_element(v) for v in value]])
    return {"paths": paths, "audit": audit}


def encode_audit(value: object) -> list[list[Any]]:
    """The plain form of dcp_safe's fingerprints (``planner_data[AUDIT_KEY]``).

    Raises:
        ValueError: not a dict of tensors' blocks 0, 1, ... of integers in [0, 2**64).
    """
    if not isinstance(value, dict):
        raise ValueError("fingerprints that are not a dict")
    found = []
    for key, blocks in value.items():
        if not isinstance(blocks, dict) or len(blocks) > _MAX_BLOCKS:
            raise ValueError("fingerprints of a tensor that are not a dict of blocks")
        count = len(blocks)
        # Ranks' partials are summed in the order their pieces arrive, so blocks come in any
        # order; what must hold is that they are exactly 0 .. n-1 (ints, not bools). The
        # type checks run in C (``map``), not a generator: 10,000 tensors a save.
        if not _only_ints(blocks) or sorted(blocks) != list(range(count)):
            raise ValueError("fingerprints of a tensor that are not blocks 0, 1, ...")
        values = [blocks[b] for b in range(count)]
        if not _only_ints(values) or min(values, default=0) < 0 or max(values, default=0) >> 64:
            raise ValueError("a fingerprint is not an integer in [0, 2**64)")
        found.append([_str_key(key), struct.pack(f">{count}Q", *values).hex()])
    return found


def _only_ints(values: Iterable[object]) -> bool:
    return set(map(type, values)) <= {int}


def _path_element(value: object) -> str | int:
    return _str_key(value) if isinstance(value, str) else require_int("a path index", value)


def decode_dcp_metadata(raw: object, manifest: Manifest, path: str) -> Metadata:
    """DCP's ``Metadata`` from its plain form, checked against ``manifest`` field by field.

    Every chunk and object must be an item of the manifest, whose record then says where its
    bytes are (``storage_data``); a chunk may not hold more elements than its item's stored
    bytes can (or ``ZSTD_MAX_RATIO`` times that, compressed), nor lie outside its tensor.

    Raises:
        CheckpointCorruptError: ``raw`` is not such a form, names a version this dcp_safe does
            not know, or disagrees with the manifest.
    """
    try:
        return _Decoder(manifest).metadata(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointCorruptError(path, f"malformed DCP metadata ({exc})") from None


def _pair(what: str, raw: object) -> tuple[Any, Any]:
    if not isinstance(raw, list) or len(raw) != 2:
        raise ValueError(f"{what} is not a pair")
    return raw[0], raw[1]


def _lookup(what: str, table: Mapping[str, T], name: object) -> T:
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"unknown {what} {str(name)[:40]!r}")
    return table[name]


@dataclass
class _Decoder:
    """One decode against one manifest: every chunk and object takes its item once."""

    manifest: Manifest
    storage: dict[MetadataIndex, StorageInfo] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)

    def metadata(self, raw: object) -> Metadata:
        top = require_keys("the metadata", raw, _TOP_KEYS)
        if top["format"] != FORMAT:
            raise ValueError(f"format is not {FORMAT!r}")
        if top["version"] != VERSION:
            raise ValueError(f"version {str(top['version'])[:20]}, this dcp_safe reads {VERSION}")
        version = top["dcp_version"]
        if version is not None and (not isinstance(version, str) or len(version) > 64):
            raise ValueError("dcp_version is not a short string")
        # Each entry takes at least one item of the manifest.
        entries = require_list("entries", top["entries"], at_most=len(self.manifest.items))
        state = dict(self.entry(raw_entry) for raw_entry in entries)
        return Metadata(
            state_dict_metadata=state,
            planner_data=self.planner(top["planner_data"]),
            storage_data=self.storage,
            storage_meta=StorageMeta(
                checkpoint_id=self.manifest.name, save_id=self.manifest.save_id
            ),
            version=version,
        )

    def entry(self, raw: object) -> tuple[str, TensorStorageMetadata | BytesStorageMetadata]:
        key, body = _pair("an entry", raw)
        key = _str_key(key)
        if key in self.keys:
            raise ValueError(f"key {key[:80]!r} appears twice")
        self.keys.add(key)
        if body is None:
            self.take(key, None, 0)
            return key, BytesStorageMetadata()
        return key, self.tensor(key, body)

    def take(self, key: str, offsets: tuple[int, ...] | None, index: int) -> ItemRecord:
        """The manifest's item for ``(key, offsets)``, recorded as where those bytes lie."""
        item, where = self.manifest.item((key, offsets)), MetadataIndex(key, offsets, index)
        if item is None or where in self.storage:
            shown = key[:80] if offsets is None else f"{key[:80]}@{list(offsets)}"
            problem = "is not an item of the manifest" if item is None else "appears twice"
            raise ValueError(f"{shown} {problem}")
        self.storage[where] = StorageInfo(
            relative_path=item.file,
            offset=item.start,
            length=item.length,
            transform_descriptors=item.transforms or None,  # a tuple: immutable, shared by copies
        )
        return item

    def tensor(self, key: str, raw: object) -> TensorStorageMetadata:
        body = require_keys(f"entry {key[:80]!r}", raw, _TENSOR_KEYS)
        fields: dict[str, Any] = {n: _lookup(n, table, body[n]) for n, table in _NAMED.items()}
        fields.update((n, _plain_bool(body[n], n)) for n in _FLAGS)
        properties = TensorProperties(**fields)
        size = tuple(_encode_dims(body["size"], "size"))
        chunks_raw = require_list("chunks", body["chunks"], at_most=len(self.manifest.items))
        chunks = [
            self.chunk(key, properties.dtype, size, raw_chunk, n)
            for n, raw_chunk in enumerate(chunks_raw)
        ]
        return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)

    def chunk(
        self, key: str, dtype: torch.dtype, size: tuple[int, ...], raw: object, index: int
    ) -> ChunkStorageMetadata:
        raw_offsets, raw_sizes = _pair("a chunk", raw)
        offsets = tuple(_encode_dims(raw_offsets, "offsets", len(size)))
        sizes = tuple(_encode_dims(raw_sizes, "sizes", len(size)))
        if any(o + s > whole for o, s, whole in zip(offsets, sizes, size, strict=True)):
            raise ValueError(f"chunk {key[:80]}@{list(offsets)} lies outside its tensor")
        item = self.take(key, offsets, index)
        # No more elements than the item's bytes can hold, each size capped first so that no
        # product of hostile sizes is ever formed.
        limit = item.length * (ZSTD_MAX_RATIO if item.transforms else 1) // max(1, dtype.itemsize)
        if math.prod(min(size, limit + 1) for size in sizes) > limit:
            raise ValueError(
                f"chunk {key[:80]} of {list(sizes)} {str(dtype)[6:]} elements is larger than"
                f" its {item.length} stored bytes can hold"
            )
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def planner(self, raw: object) -> dict[str, Any] | None:
        if raw is None:
            return None
        body = require_keys("planner_data", raw, _PLANNER_KEYS)
        limit = len(self.manifest.items) + len(self.keys)
        data: dict[str, Any] = {}
        for pair in require_list("paths", body["paths"], at_most=limit):
            key, path = _pair("a path", pair)
            key = _str_key(key)
            if key in data or key == layout.AUDIT_KEY:
                raise ValueError(f"path of {key[:80]!r} given twice")
            data[key] = tuple(map(_path_element, require_list("a path", path, at_most=_MAX_PATH)))
        if body["audit"] is not None:
            data[layout.AUDIT_KEY] = self.audit(body["audit"], limit)
        return data

    @staticmethod
    def audit(raw: object, limit: int) -> dict[str, dict[int, int]]:
        found: dict[str, dict[int, int]] = {}
        for pair in require_list("audit", raw, at_most=limit):
            key, text = _pair("fingerprints", pair)
            key = _str_key(key)
            if not isinstance(text, str) or len(text) % 16 or len(text) > 16 * _MAX_BLOCKS:
                raise ValueError(f"fingerprints of {key[:80]!r} are not 16 hex digits a block")
            data = bytes.fromhex(text)  # ValueError if not hex
            if key in found:
                raise ValueError(f"fingerprints of {key[:80]!r} given twice")
            found[key] = dict(enumerate(struct.unpack(f">{len(data) // 8}Q", data)))
        return found


def check_declared_sizes(metadata: Metadata, path: str) -> None:
    """Every tensor of a whole checkpoint's metadata declares no more elements than its chunks
    hold (DCP's planner saves chunks that cover it), nor more than ``MAX_INT`` bytes: a size
    it does not store is never shown by ``inspect``, passed by ``verify`` or allocated by a
    load or an export. (Not part of :func:`decode_dcp_metadata`: a rank's report holds only
    its own chunks.)

    Raises:
        CheckpointCorruptError: a tensor declares more.
    """
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        numel = math.prod(entry.size)  # at most 64 factors below 2**63: a small integer
        held = sum(math.prod(chunk.sizes) for chunk in entry.chunks)  # each within its item
        if numel > held or numel * entry.properties.dtype.itemsize > MAX_INT:
            raise CheckpointCorruptError(
                path,
                f"malformed DCP metadata (tensor {key[:80]} declares {list(entry.size)}"
                f" {str(entry.properties.dtype)[6:]} elements ({numel}), more than its"
                f" {len(entry.chunks)} chunk(s) hold ({held}))",
            )
