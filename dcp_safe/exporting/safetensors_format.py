"""The safetensors layout, written as a stream: headers, shard plan, index, and a reader check.

``safetensors.save_file`` wants every tensor in memory at once; here the header is computed from
DCP's metadata before any data is read, and the tensors are appended in the header's order.
Shards are split as ``huggingface_hub``'s ``split_torch_state_dict_into_shards`` splits them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import torch
from safetensors import safe_open

from dcp_safe import layout
from dcp_safe.errors import ConfigError, StorageError
from dcp_safe.exporting.consolidate import Consolidator
from dcp_safe.exporting.publish import StagedExport, write_tensor
from dcp_safe.exporting.selection import Selection, TensorEntry

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "check_max_shard_bytes",
    "encode_header",
    "encode_index",
    "holds",
    "plan_shards",
    "shard_names",
    "write",
]

#: Hugging Face's default ``max_shard_size="5GB"`` (decimal, as it parses it).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_RESERVED = "__metadata__"  # the header's own entry: no tensor may have this key
_ALIGN = 8  # the header is padded with spaces so the data section starts 8-byte aligned

# The dtype codes of the safetensors format (as safetensors.torch names them).
_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def holds(dtype: torch.dtype) -> bool:
    """Whether the safetensors format can name ``dtype``."""
    return dtype in _CODES


def write(
    staged: StagedExport, source: Consolidator, selection: Selection, max_shard_bytes: int
) -> dict[str, str]:
    """Write the selected tensors as one file or as shards and their index, each file checked
    with the reference reader; the entries skipped (every non-tensor), each with the reason.

    Raises:
        ConfigError: the selection holds no tensors, or a tensor named ``__metadata__``.
        StorageError: a write failed, or the reader refuses a file written.
    """
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
            if sink.tell() != len(header) + sum(e.out_nbytes for e in entries):
                raise StorageError("write", staged.path(file_name), "size is off")
        _check_file(staged.path(file_name), entries)
    if len(files) > 1:
        with staged.open(layout.SAFETENSORS_INDEX) as sink:
            sink.write(encode_index(files))
    return dict.fromkeys(selection.objects, "not a tensor (safetensors holds tensors only)")


def check_max_shard_bytes(max_shard_bytes: object) -> None:
    """Raise :class:`~dcp_safe.errors.ConfigError` unless it is a positive ``int``."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise ConfigError(f"max_shard_bytes must be an int, got {max_shard_bytes!r}")
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}")


def plan_shards(entries: Sequence[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """``entries`` (in order) split into shards of at most ``max_shard_bytes`` of tensor data,
    except a tensor larger than that, which gets a shard of its own.

    Raises:
        ConfigError: a key is ``__metadata__``.
    """
    if any(entry.key == _RESERVED for entry in entries):
        raise ConfigError(
            f"safetensors reserves the key {_RESERVED!r} for its header, and a tensor of the"
            f" checkpoint has it: export with format='torch', or select the other entries"
            " with keys= (dcp-safe export --keys)"
        )
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.out_nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.out_nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """File names for ``count`` shards, as Hugging Face names them."""
    if count == 1:
        return [layout.SAFETENSORS_FILE]
    return [layout.safetensors_shard_name(i, count) for i in range(1, count + 1)]


def encode_header(entries: Sequence[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding ``entries`` in this order."""
    header: dict[str, object] = {_RESERVED: metadata}
    offset = 0
    for entry in entries:
        end = offset + entry.out_nbytes
        header[entry.key] = {
            "dtype": _CODES[entry.out_dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def encode_index(files: dict[str, list[TensorEntry]]) -> bytes:
    """``model.safetensors.index.json`` for the shards ``files`` (file name -> its entries)."""
    weight_map = {entry.key: name for name, entries in files.items() for entry in entries}
    total = sum(entry.out_nbytes for entries in files.values() for entry in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode("utf-8")


def _check_file(path: str, entries: Sequence[TensorEntry]) -> None:
    """Open a written file with the reference reader and compare its table of contents.

    Raises:
        StorageError: the reader refuses the file or lists other tensors.
    """
    try:
        with safe_open(path, framework="pt") as opened:  # type: ignore[no-untyped-call]
            keys = sorted(opened.keys())
    except Exception as exc:
        raise StorageError("check", path, f"safetensors refuses the file: {exc}") from exc
    if keys != sorted(entry.key for entry in entries):
        raise StorageError("check", path, "safetensors lists other tensors than were written")
