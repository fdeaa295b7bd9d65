"""The bytes ``torch.save`` writes for one plain tensor, laid down and recognised without it.

A ``torch.save`` stream costs about 0.5 ms to write and 0.8 ms to read per item, which dominates
a checkpoint of thousands of small tensors. For a contiguous CPU tensor of a common dtype the
stream is fully determined by (dtype, shape), so it is built from a template: ``prefix`` + the
tensor's own bytes + ``suffix``; a stored item whose bytes around the payload match is read
straight into the destination, anything else is left to ``torch.load`` (docs/benchmarks.md).

The template is learnt from the running torch, not hard-coded: a dtype is handled here only if
a 3-element ``torch.save`` is byte-identical to what this module writes (the serialization id
aside), so a torch that changes its format turns this path off instead of writing files torch
cannot read. :func:`write_item` lays down one write item's stored form, for the writer and the
manager's in-memory tier.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import io
import math
import struct
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
import zstandard
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_safe.checkpoints.items import ZSTD_DESCRIPTOR
from dcp_safe.checkpoints.torch_zip import MemorySource, open_archive
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.blocks import BLOCK_DIGEST_MIN_BYTES
from dcp_safe.manifest.streams import HashingSink
from dcp_safe.torch_compat import (
    TensorStub,
    legacy_storage_type,
    pickle_stubs,
    save_tensor_without_crc,
)

# Past this, torch's writer switches records to zip64 forms that the template does not cover.
_MAX_PAYLOAD = (1 << 32) - (1 << 20)
_LOCAL, _DESCRIPTOR, _CENTRAL = 0x04034B50, 0x08074B50, 0x02014B50
_ZIP64_END, _ZIP64_LOCATOR, _END = 0x06064B50, 0x07064B50, 0x06054B50
_FLAGS = 0x0808  # sizes in a data descriptor after each record; UTF-8 names
_ID_DIGITS = 40
# torch.save writes a random id per call; torch only logs it. One fixed id, the same in every
# process, lets any rank reproduce the bytes another wrote (the manager's in-memory tier checks a
# kept copy against the manifest that way). 128 bits take at most 39 of its digits.
_SERIALIZATION_ID = (
    f"{int.from_bytes(hashlib.sha256(b'dcp_safe').digest()[:16], 'big'):0{_ID_DIGITS}d}".encode()
)


@dataclass(frozen=True)
class TensorLayout:
    """One stored tensor item: ``prefix``, ``payload`` tensor bytes, ``suffix``; ``id_at`` is
    where, in ``suffix``, the serialization id lies: the only bytes a recognised item may differ in.
    """

    prefix: bytes
    payload: int
    suffix: bytes
    id_at: int

    @property
    def length(self) -> int:
        return len(self.prefix) + self.payload + len(self.suffix)

    def matches(self, prefix: bytes | bytearray | memoryview, suffix: bytes | memoryview) -> bool:
        """Whether the bytes around a stored payload are exactly this layout's."""
        tail = bytes(suffix)
        at, end = self.id_at, self.id_at + _ID_DIGITS
        return (
            bytes(prefix) == self.prefix
            and len(tail) == len(self.suffix)
            and tail[:at] == self.suffix[:at]
            and tail[end:] == self.suffix[end:]
            and tail[at:end].isdigit()
        )


@dataclass(frozen=True)
class TorchFileFormat:
    """What torch's writer puts in every tensor stream, learnt from the running torch: the
    records' folder name, each record's name and constant content (in order), the alignment."""

    archive: str
    records: tuple[tuple[str, bytes | None], ...]
    alignment: int


@functools.cache
def learnt_format() -> TorchFileFormat | None:
    """What torch's writer puts in every tensor stream (None: not laid out as understood here)."""
    try:
        out = io.BytesIO()
        save_tensor_without_crc(torch.zeros(3), out)
        source = MemorySource(out.getvalue())
        archive = open_archive(source, "torch.save", "a tensor")
        records = {kind: bytes(source.read_at(*where)) for kind, where in archive.records.items()}
        constant = {"data.pkl", "data/0", ".data/serialization_id"}
        named = tuple(
            (f"{archive.prefix}/{kind}", None if kind in constant else content)
            for kind, content in records.items()
        )
        alignment = records.get(".storage_alignment", b"64")
        return TorchFileFormat(archive.prefix, named, int(alignment))
    except ValueError:  # CheckpointCorruptError too
        return None


@functools.cache
def _agrees_with_torch(dtype: torch.dtype) -> bool:
    """Whether this module writes ``dtype`` byte for byte as ``torch.save`` does."""
    layout = _build(dtype, (3,))  # None without a learnt format or a storage type for dtype
    if layout is None:
        return False
    sample = torch.zeros(3, dtype=dtype)
    expected = io.BytesIO()
    save_tensor_without_crc(sample, expected)
    raw = expected.getvalue()
    start, end = len(layout.prefix), len(layout.prefix) + layout.payload
    return (
        len(raw) == layout.length
        and raw[start:end] == tensor_bytes(sample)
        and layout.matches(raw[:start], raw[end:])
    )


def _build(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorLayout | None:
    fmt, storage_type = learnt_format(), legacy_storage_type(dtype)
    if fmt is None or storage_type is None:
        return None
    payload = math.prod(shape) * dtype.itemsize
    if not 0 < payload <= _MAX_PAYLOAD:  # torch lays an empty storage out another way
        return None
    content = {
        "data.pkl": pickle_stubs(TensorStub("0", storage_type, shape)),
        ".data/serialization_id": _SERIALIZATION_ID,
    }
    head, tail = bytearray(), bytearray()
    out, position, central, id_at = head, 0, bytearray(), -1
    for name, constant in fmt.records:
        kind = name.partition("/")[2]
        data = constant if constant is not None else content.get(kind, b"")
        size = payload if kind == "data/0" else len(data)
        encoded = name.encode()
        start = position + 30 + len(encoded) + 4
        pad = -start % fmt.alignment
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        out += struct.pack(
            "<IHHHHHIIIHH", _LOCAL, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), len(extra)
        )
        out += encoded + extra
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII", _CENTRAL, 0, 0, _FLAGS, 0, 0, 0, 0, size, size,
            len(encoded), 0, 0, 0, 0, 0, position,
        ) + encoded  # fmt: skip
        if kind == "data/0":
            out = tail  # the tensor's bytes go between the two
        else:
            if kind == ".data/serialization_id":
                id_at = len(tail)
            out += data
        out += struct.pack("<IIII", _DESCRIPTOR, 0, size, size)
        position = start + pad + size + 16
    if out is not tail or id_at < 0:
        return None
    count, directory_at = len(fmt.records), position
    tail += central
    zip64_at = directory_at + len(central)
    tail += struct.pack(
        "<IQHHIIQQQQ", _ZIP64_END, 44, 0x031E, 0x2D, 0, 0, count, count, len(central),
        directory_at,
    )  # fmt: skip
    tail += struct.pack("<IIQI", _ZIP64_LOCATOR, 0, zip64_at, 1)
    tail += struct.pack("<IHHHHIIH", _END, 0, 0, count, count, len(central), directory_at, 0)
    return TensorLayout(bytes(head), payload, bytes(tail), id_at)


@functools.lru_cache(maxsize=65536)  # shapes come from models: few, but bound it anyway
def layout_for(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorLayout | None:
    """The stored form of a contiguous tensor of ``dtype`` and ``shape``, or ``None`` when
    only ``torch.save`` itself may write it (an unusual dtype, empty, over 4 GiB, another
    torch)."""
    # A torch.Size finds the entry of the equal tuple; only a miss pays for the conversion
    # (the pickle must name a tuple, as Tensor.__reduce_ex__ does, not a torch.Size).
    shape = tuple(int(size) for size in shape)
    return _build(dtype, shape) if _agrees_with_torch(dtype) else None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    # ctypes rather than numpy (not a dependency); the caller keeps ``tensor`` alive meanwhile.
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def template_parts(tensor: torch.Tensor) -> tuple[bytes, memoryview, bytes] | None:
    """``tensor``'s stored form as (prefix, its own bytes, suffix), written or hashed in that
    order, or ``None`` for anything but a plain contiguous CPU tensor with no autograd history,
    of a dtype and size the template covers."""
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout is not torch.strided
        or tensor.requires_grad
        or tensor.storage_offset() != 0
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    ):
        return None
    layout = layout_for(tensor.dtype, tensor.shape)
    return None if layout is None else (layout.prefix, tensor_bytes(tensor), layout.suffix)


def minimal_cpu_tensor(data: Any) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its bytes (torch.save writes whole storages)."""
    if not isinstance(data, torch.Tensor):
        raise ConfigError(f"planner resolved a tensor item to {type(data).__name__}")
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def write_item(
    out: HashingSink,
    item: WriteItem,
    data: Any,
    *,
    compressed: bool,
    block_bytes: int | None = None,
) -> tuple[str, ...]:
    """Write ``data`` (the planner's ``resolve_data(item)``) to ``out`` as the writer stores it;
    return the item's transform descriptors. ``block_bytes``: also have ``out`` digest a large
    uncompressed tensor's data in blocks of this size (:meth:`HashingSink.take_blocks`), only
    where the data lies as one run of the tensor's raw bytes, as a partial read assumes."""
    target: Any = out
    if compressed:
        target = zstandard.ZstdCompressor().stream_writer(cast(IO[bytes], out), closefd=False)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise ConfigError(f"planner resolved {item.index.fqn} to {type(data).__name__}")
        target.write(data.getbuffer())
    else:
        tensor = minimal_cpu_tensor(data)
        # torch.save's exact bytes from a template where it can (36 us an item instead of
        # 370 here); torch.save itself for the rest.
        parts = template_parts(tensor)
        if parts is None:
            save_tensor_without_crc(tensor, target)
        else:
            prefix, payload, _ = parts
            if block_bytes and not compressed and payload.nbytes >= BLOCK_DIGEST_MIN_BYTES:
                out.hash_blocks(at=len(prefix), length=payload.nbytes, block_bytes=block_bytes)
            for part in parts:
                target.write(part)
    if compressed:
        target.close()
        return (ZSTD_DESCRIPTOR,)
    return ()
