"""The two export formats, each written as a stream and checked with its reference reader.

safetensors: ``safetensors.save_file`` wants every tensor in memory at once; here the header is
computed from DCP's metadata before any data is read, and the tensors are appended in the
header's order. Shards are split as ``huggingface_hub``'s ``split_torch_state_dict_into_shards``
splits them.

torch: ``torch.save`` needs every tensor in memory; its format (a zip of a pickle that rebuilds
each tensor from a storage record) does not. The pickle is written first, then each tensor's
bytes. The pickle is exactly what ``Tensor.__reduce_ex__`` pickles, so
``torch.load(weights_only=True)`` loads the file; the constant records are learnt from the
running torch's own ``torch.save``, not hard-coded.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import struct
import zipfile
from collections.abc import Sequence
from typing import IO, Any

import torch
from safetensors import safe_open

from dcp_safe import layout
from dcp_safe.adapters.tensor_records import learnt_format
from dcp_safe.errors import ConfigError, StorageError
from dcp_safe.exporting.consolidate import Consolidator, NotPlainData, Selection, TensorEntry, runs
from dcp_safe.exporting.publish import StagedExport, write_tensor
from dcp_safe.reading.safetensors_import import DTYPES, RESERVED
from dcp_safe.torch_compat import TensorStub, legacy_storage_type, pickle_stubs

#: Hugging Face's default ``max_shard_size="5GB"`` (decimal, as it parses it).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_ALIGN = 8  # the header is padded with spaces so the data section starts 8-byte aligned
_CODES = {dtype: code for code, dtype in DTYPES.items()}  # the format's dtype codes


def safetensors_holds(dtype: torch.dtype) -> bool:
    """Whether the safetensors format can name ``dtype``."""
    return dtype in _CODES


def write_safetensors(
    staged: StagedExport, source: Consolidator, selection: Selection, max_shard_bytes: int
) -> dict[str, str]:
    """Write the selected tensors as one file or as shards and their index, each file checked
    with the reference reader; the entries skipped (every non-tensor), each with the reason.
    ConfigError: no tensors, or one named ``__metadata__``; StorageError: a write failed, or the
    reader refuses a file written."""
    if not selection.tensors:
        raise ConfigError("nothing to export: the selected entries hold no tensors")
    shards = plan_shards(selection.tensors, max_shard_bytes)
    files = dict(zip(shard_names(len(shards)), shards, strict=True))
    metadata = {"format": "pt", "source": f"dcp_safe checkpoint {source.name}"}
    for file_name, entries in files.items():
        header = encode_header(entries, metadata)
        with staged.open(file_name) as sink:
            sink.write(header)
            source.each_tensor(entries, lambda e, t: write_tensor(sink, t, e.out_dtype))
        _check_safetensors(staged.path(file_name), entries)
    if len(files) > 1:
        with staged.open(layout.SAFETENSORS_INDEX) as sink:
            sink.write(encode_index(files))
    return dict.fromkeys(selection.objects, "not a tensor (safetensors holds tensors only)")


def plan_shards(entries: Sequence[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """``entries`` (in order) split into shards of at most ``max_shard_bytes`` of tensor data,
    except a tensor larger than that, which gets a shard of its own (ConfigError: a key is
    ``__metadata__``)."""
    if any(entry.key == RESERVED for entry in entries):
        raise ConfigError(
            f"safetensors reserves the key {RESERVED!r} for its header, and a tensor of the"
            f" checkpoint has it: export with format='torch', or select the other entries"
            " with keys= (dcp-safe export --keys)"
        )
    return runs(entries, max_shard_bytes, written=True)


def shard_names(count: int) -> list[str]:
    """File names for ``count`` shards, as Hugging Face names them."""
    if count == 1:
        return [layout.SAFETENSORS_FILE]
    return [layout.safetensors_shard_name(i, count) for i in range(1, count + 1)]


def encode_header(entries: Sequence[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding ``entries`` in this order."""
    header: dict[str, object] = {RESERVED: metadata}
    offset = 0
    for entry in entries:
        span = [offset, offset + entry.out_nbytes]
        shape = list(entry.shape)
        header[entry.key] = {"dtype": _CODES[entry.out_dtype], "shape": shape, "data_offsets": span}
        offset = span[1]
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def encode_index(files: dict[str, list[TensorEntry]]) -> bytes:
    """``model.safetensors.index.json`` for the shards ``files`` (file name -> its entries)."""
    weight_map = {entry.key: name for name, entries in files.items() for entry in entries}
    total = sum(entry.out_nbytes for entries in files.values() for entry in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode("utf-8")


def _check_safetensors(path: str, entries: Sequence[TensorEntry]) -> None:
    """Open a written file with the reference reader and compare its table of contents
    (StorageError: the reader refuses the file or lists other tensors)."""
    try:
        with safe_open(path, framework="pt") as opened:  # type: ignore[no-untyped-call]
            keys = sorted(opened.keys())
    except Exception as exc:
        raise StorageError("check", path, f"safetensors refuses the file: {exc}") from exc
    if keys != sorted(entry.key for entry in entries):
        raise StorageError("check", path, "safetensors lists other tensors than were written")


# ---------------------------------------------------------------- torch.save

_ZIP64_EXTRA = 20  # the zip64 field zipfile adds to a local header opened with force_zip64


def torch_holds(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` has a typed-storage class for the pickle."""
    return legacy_storage_type(dtype) is not None


def write_torch(staged: StagedExport, source: Consolidator, selection: Selection) -> dict[str, str]:
    """Write ``model.pt`` of the selected tensors and the plain-data objects, checked by
    loading it back; the objects skipped (not plain data), each with the reason. ConfigError:
    no tensors and no plain data; StorageError: a write failed, or ``torch.load`` finds other
    contents.

    The loaded file is a flat dict from key to tensor or object, in key order. The pickle goes
    first (each tensor a stub naming its record), then the constant records before the data,
    each tensor's record as it is read, the records after the data, and the zip directory.
    """
    objects = source.objects(selection.objects)
    skipped = {k: v.reason for k, v in objects.items() if isinstance(v, NotPlainData)}
    plain = {k: v for k, v in objects.items() if k not in skipped}
    if not selection.tensors and not plain:
        raise ConfigError("nothing to export: the selection holds no tensors and no plain data")
    learnt = learnt_format()  # the records torch writes around a tensor's
    if learnt is None:
        raise ConfigError("format='torch' does not know this torch's file layout; use safetensors")
    kinds = [(name.partition("/")[2], content) for name, content in learnt.records]
    data = next(i for i, (kind, _) in enumerate(kinds) if kind.startswith("data/"))
    index = {entry.key: str(i) for i, entry in enumerate(selection.tensors)}
    state: dict[str, Any] = dict(plain)
    for entry in selection.tensors:
        storage_type = legacy_storage_type(entry.out_dtype)
        assert storage_type is not None  # refused up front (torch_holds)
        state[entry.key] = TensorStub(index[entry.key], storage_type, entry.shape)
    with staged.open(layout.TORCH_FILE) as sink:
        # No seek on the sink: zipfile writes each record front to back.
        archive = zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED, allowZip64=True)

        def record(kind: str, size: int) -> IO[bytes]:
            """A new record whose data starts on the alignment torch uses (padding in an
            extra field of the local header, as torch pads)."""
            name = f"{learnt.archive}/{kind}"
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.file_size = size
            fixed = sink.tell() + 30 + len(name.encode()) + 4 + _ZIP64_EXTRA
            pad = -fixed % learnt.alignment
            info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            return archive.open(info, "w", force_zip64=True)

        def put(kind: str, content: bytes | None) -> None:
            if content is not None:
                with record(kind, len(content)) as out:
                    out.write(content)

        def add(entry: TensorEntry, tensor: torch.Tensor) -> None:
            with record(f"data/{index[entry.key]}", entry.out_nbytes) as out:
                write_tensor(out, tensor, entry.out_dtype)

        try:
            put("data.pkl", pickle_stubs(dict(sorted(state.items()))))
            for kind, content in kinds[:data]:
                put(kind, content)
            source.each_tensor(selection.tensors, add)
            for kind, content in kinds[data:]:
                put(kind, content)
            put(".data/serialization_id", f"{secrets.randbits(128):040d}"[-40:].encode())
            archive.close()
        except BaseException:
            # Wound down into the file being thrown away; else its finalizer would try, into
            # a closed file. A second failure there says nothing new.
            with contextlib.suppress(Exception):
                archive.close()
            raise
    _check_torch(staged.path(layout.TORCH_FILE), selection.tensors, plain)
    return skipped


def _check_torch(path: str, tensors: Sequence[TensorEntry], objects: dict[str, Any]) -> None:
    """Load a written file as a user will (``torch.load(weights_only=True)``, with ``mmap=True``
    so the tensor data is mapped, not read) and compare its keys, dtypes and shapes
    (StorageError: torch refuses the file or finds other contents)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise StorageError("check", path, f"torch.load refuses the file: {exc}") from exc
    expected = {entry.key: (entry.out_dtype, entry.shape) for entry in tensors}
    found = {k: (v.dtype, tuple(v.shape)) for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    if found != expected or set(loaded) != set(expected) | set(objects):
        raise StorageError("check", path, "torch.load finds other contents than were written")
