"""Building hostile items and metadata, as anyone who can write a checkpoint root can.

Shared by the unit tests of the item decoder and the hostile corpus: each helper writes what a
root writer could (an item's bytes replaced, the shard, the rank manifest and the manifest
re-checksummed and the marker re-written to match), never anything dcp_safe would refuse for a
reason other than the one under test.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import zstandard
from support import resign_manifest

from dcp_safe import layout
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes

SHARD = layout.shard_file_name(0, 0)
RANK_MANIFEST = layout.rank_manifest_name(0)
_ALGORITHM = ChecksumAlgorithm.XXH3_128


class Call:
    """Pickles as ``function(*args)``: a REDUCE of a real, importable global."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.function, self.args)


def call_pickle(function: Any, *args: Any) -> bytes:
    return pickle.dumps(Call(function, *args), protocol=2)


class _Storage:
    pass


def tensor_pickle(shape: tuple[int, ...], numel: int, storage: type = torch.FloatStorage) -> bytes:
    """The pickle ``torch.save`` writes for a contiguous tensor of ``shape`` whose storage
    (record ``data/0``) says it holds ``numel`` elements."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    args = (_Storage(), 0, shape, tuple(reversed(stride)), False, collections.OrderedDict())

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", storage, "0", "cpu", numel) if isinstance(obj, _Storage) else None

    out = io.BytesIO()
    Pickler(out, protocol=2).dump(Call(torch._utils._rebuild_tensor_v2, *args))
    return out.getvalue()


def torch_archive(
    pickled: bytes,
    records: dict[str, bytes] | None = None,
    *,
    deflate: Iterable[str] = (),
    zeros: dict[str, int] | None = None,
) -> bytes:
    """A ``torch.save``-shaped zip: ``archive/data.pkl``, ``records``, and records of
    ``zeros[name]`` zero bytes written in chunks; the records named in ``deflate`` DEFLATEd."""
    deflated = set(deflate)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", allowZip64=True) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")  # torch's reader requires it
        for name, data in (records or {}).items():
            method = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            archive.writestr(f"archive/{name}", data, compress_type=method)
        for name, size in (zeros or {}).items():
            method = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            info = zipfile.ZipInfo(f"archive/{name}")
            info.compress_type = method
            chunk = bytes(1 << 24)
            with archive.open(info, "w", force_zip64=True) as stream:
                for at in range(0, size, len(chunk)):
                    stream.write(chunk[: min(len(chunk), size - at)])
    return out.getvalue()


def zstd_zeros(size: int) -> bytes:
    """One zstd frame of ``size`` zero bytes (about 32 KiB per GiB)."""
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(out, closefd=False)
    chunk = bytes(1 << 24)
    for at in range(0, size, len(chunk)):
        writer.write(chunk[: min(len(chunk), size - at)])
    writer.close()
    return out.getvalue()


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def replace_item(root: Path, name: str, fqn: str, offset: list[int] | None, data: bytes) -> None:
    """Put ``data`` in place of item ``(fqn, offset)``: the shard is rewritten with every item
    moved to fit, and the rank manifest, the manifest and the marker are rewritten to match."""
    folder = Path(root) / name
    manifest = json.loads((folder / layout.MANIFEST).read_bytes())
    target = next(i for i in manifest["items"] if i["fqn"] == fqn and i["offset"] == offset)
    shard = (folder / target["file"]).read_bytes()
    moved: dict[tuple[str, Any], dict[str, Any]] = {}
    out = bytearray()
    in_file = sorted((i for i in manifest["items"] if i["file"] == target["file"]), key=_start)
    for item in in_file:
        body = data if item is target else shard[item["start"] : item["start"] + item["length"]]
        moved[item["fqn"], _key(item["offset"])] = {
            "start": len(out),
            "length": len(body),
            "checksum": digest_bytes(body, _ALGORITHM),
        }
        out += body
    (folder / target["file"]).write_bytes(bytes(out))
    rank = json.loads((folder / RANK_MANIFEST).read_bytes())
    for document in (manifest, rank):
        for item in document["items"]:
            item.update(moved.get((item["fqn"], _key(item["offset"])), {}))
        for record in document["files"]:
            if record["path"] == target["file"]:
                record["size"] = len(out)
    rank_bytes = _canonical(rank)
    (folder / RANK_MANIFEST).write_bytes(rank_bytes)
    metadata_bytes = _moved_metadata(folder, moved)

    def edit(raw: dict[str, Any]) -> None:
        raw["items"], raw["files"] = manifest["items"], manifest["files"]
        for record in raw["files"]:
            if record["path"] == RANK_MANIFEST:
                record["size"] = len(rank_bytes)
                record["checksum"] = digest_bytes(rank_bytes, _ALGORITHM)
            if record["path"] == layout.DCP_METADATA:
                record["size"] = len(metadata_bytes)
                record["checksum"] = digest_bytes(metadata_bytes, _ALGORITHM)

    resign_manifest(root, name, edit)


def _moved_metadata(folder: Path, moved: dict[tuple[str, Any], dict[str, Any]]) -> bytes:
    """``.metadata`` with its storage map moved as the items were (what torch's reader and
    earlier dcp_safe versions read the byte ranges from)."""
    metadata = pickle.loads((folder / layout.DCP_METADATA).read_bytes())
    for index, info in metadata.storage_data.items():
        offset = None if index.offset is None else tuple(index.offset)
        now = moved.get((index.fqn, offset))
        if now is not None:
            info.offset, info.length = now["start"], now["length"]
    data = pickle.dumps(metadata)
    (folder / layout.DCP_METADATA).write_bytes(data)
    return data


def _start(item: dict[str, Any]) -> int:
    return int(item["start"])


def _key(offset: list[int] | None) -> Any:
    return None if offset is None else tuple(offset)


def _canonical(raw: dict[str, Any]) -> bytes:
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


def item_bytes(root: Path, name: str, fqn: str, offset: list[int] | None) -> bytes:
    folder = Path(root) / name
    manifest = json.loads((folder / layout.MANIFEST).read_bytes())
    item = next(i for i in manifest["items"] if i["fqn"] == fqn and i["offset"] == offset)
    shard = (folder / item["file"]).read_bytes()
    return shard[item["start"] : item["start"] + item["length"]]


def strip_plain_metadata(root: Path, name: str) -> None:
    """Make ``name`` what checkpoints written before the plain metadata are (re-signed)."""
    resign_manifest(root, name, lambda raw: raw.pop("dcp_metadata", None))


def replace_metadata(root: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``.metadata`` and re-checksum it in the manifest (re-signed)."""
    (Path(root) / name / layout.DCP_METADATA).write_bytes(data)

    def edit(raw: dict[str, Any]) -> None:
        for record in raw["files"]:
            if record["path"] == layout.DCP_METADATA:
                record["size"], record["checksum"] = len(data), digest_bytes(data, _ALGORITHM)

    resign_manifest(root, name, edit)


def pickled_metadata(root: Path, name: str) -> Any:
    """The checkpoint's own ``.metadata``, unpickled (the test wrote it: it trusts it)."""
    return pickle.loads((Path(root) / name / layout.DCP_METADATA).read_bytes())


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def build_onto_class_prefix(
    module: str, name: str, attribute: str, value: tuple[str, str]
) -> bytes:
    """Protocol-2 opcodes that ``setattr(module.name, attribute, value_module.value_name)``
    with ``BUILD`` and leave the stack as it was: prepended to a pickle's body, they run
    first and the pickle still yields what it did."""
    state = (
        b"N}"  # (None, {attribute: value}): BUILD's slot state, set with setattr
        + b"X"
        + struct.pack("<I", len(attribute))
        + attribute.encode()
        + f"c{value[0]}\n{value[1]}\n".encode()
        + b"s\x86"
    )
    return f"c{module}\n{name}\n".encode() + state + b"b0"


def poisoned_metadata(metadata: Any) -> bytes:
    """``metadata`` pickled with only DCP's own globals, after a ``BUILD`` that replaces
    ``MetadataIndex.__eq__`` (every later lookup of a storage entry, in every load and save of
    the process, then fails)."""
    body = pickle.dumps(metadata, protocol=2)
    assert body[:2] == b"\x80\x02"
    prefix = build_onto_class_prefix(
        _METADATA_MODULE, "MetadataIndex", "__eq__", ("collections", "OrderedDict")
    )
    return b"\x80\x02" + prefix + body[2:]


def memo_shared_metadata(metadata: Any, entries: int = 4000, chunks: int = 4000) -> bytes:
    """A small ``.metadata`` whose every tensor entry shares one list of ``chunks`` chunks
    (the pickle memo makes a reference cost 2 bytes): ``entries * chunks`` to walk."""
    template = next(
        v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks") and v.chunks
    )
    shared = [template.chunks[0]] * chunks
    state = {}
    for n in range(entries):
        entry = type(template)(properties=template.properties, size=template.size, chunks=shared)
        state[f"k{n}"] = entry
    odd = type(metadata)(state_dict_metadata=state, storage_data=metadata.storage_data)
    return pickle.dumps(odd, protocol=2)


def wrong_types_metadata(metadata: Any) -> bytes:
    """DCP's own types with the wrong things in them (a size that is a string, chunks that are
    a number): all globals a restricted unpickler admits."""
    odd = pickle.loads(pickle.dumps(metadata))
    for entry in odd.state_dict_metadata.values():
        if hasattr(entry, "chunks"):
            entry.size = "16x8"
            entry.chunks = 5
    return pickle.dumps(odd, protocol=2)


def outside_metadata(metadata: Any, target: str) -> bytes:
    """DCP's own metadata whose every item is said to lie in ``target`` instead."""
    odd = pickle.loads(pickle.dumps(metadata))
    for info in odd.storage_data.values():
        info.relative_path = target
    return pickle.dumps(odd, protocol=2)
