"""One item's bytes to what it holds, bounded by what the checkpoint declares for it.

Three steps, each bounded before it allocates: its transforms (zstd inflated in chunks, no
further than the item may hold: one byte more is an
:class:`~dcp_safe.errors.UnsafeCheckpointError`), its ``torch.save`` archive
(:mod:`dcp_safe.checkpoints.torch_zip`), its pickle (:mod:`dcp_safe.checkpoints.item_pickles`).
The reader and deep verification both decode through here, so what verifies is what loads.
Plain tensors laid out exactly as ``torch.save`` writes them never come here
(:mod:`dcp_safe.reading.tensors`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
import zstandard
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_safe.checkpoints.item_pickles import TENSOR_MAX_OPS, ItemUnpickler, scan
from dcp_safe.checkpoints.torch_zip import MemorySource, Source, TorchArchive, open_archive
from dcp_safe.errors import CheckpointCorruptError, UnsafeCheckpointError
from dcp_safe.manifest.schema import ItemKey, item_key
from dcp_safe.manifest.streams import read_verified
from dcp_safe.torch_compat import ZStandard

# The reader's name for it: one item's bytes, read and checked before anything decodes them.
read_item = read_verified

__all__ = [
    "OBJECT_MAX_DECODED_BYTES",
    "TENSOR_ARCHIVE_BYTES",
    "ZSTD_DESCRIPTOR",
    "decode_tensor_item",
    "decode_transforms",
    "item_archive",
    "read_item",
    "stored_tensors",
    "tensor_item_bound",
]

#: The transform descriptor of DCP's zstd extension (what ``SafeStorageWriter`` records).
ZSTD_DESCRIPTOR = f"{ZStandard.registry_name()}/1"
#: A compressed object item decodes to at most this many bytes (a larger one needs
#: ``allow_pickle=True`` or no compression).
OBJECT_MAX_DECODED_BYTES = 256 << 20
#: What a ``torch.save`` archive adds to one tensor's bytes, at most: its records' headers and
#: 64-byte alignment, the pickle, the directory (about 1.3 KiB as torch writes it).
TENSOR_ARCHIVE_BYTES = 64 << 10
# The pickle of one tensor (about 200 bytes; 64 sizes and strides fit many times over).
_TENSOR_PICKLE_MAX_BYTES = 64 << 10
_TENSOR_MAX_RECORDS = 16
_CHUNK_BYTES = 1 << 20
_BOMB = "decoding it would take more memory than the checkpoint declares for it"


def stored_tensors(metadata: Metadata | None) -> dict[ItemKey, tuple[torch.dtype, tuple[int, ...]]]:
    """Each stored tensor chunk's dtype and shape, by its manifest item key."""
    found: dict[ItemKey, tuple[torch.dtype, tuple[int, ...]]] = {}
    if metadata is None:
        return found
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            for chunk in entry.chunks:
                found[item_key(fqn, chunk.offsets)] = (dtype, tuple(int(s) for s in chunk.sizes))
    return found


def tensor_item_bound(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """The most bytes a stored tensor of ``dtype`` and ``shape`` decodes to (the metadata's
    decoder has bounded its sizes against the item already)."""
    count = 1
    for size in shape:
        count *= size
    return count * max(1, dtype.itemsize) + TENSOR_ARCHIVE_BYTES


def decode_transforms(
    raw: bytes | bytearray | memoryview,
    transforms: Iterable[str],
    *,
    max_bytes: int | None,
    path: str,
    item: str,
) -> bytes | bytearray | memoryview:
    """``raw`` with its transforms undone, at most ``max_bytes`` (``None``: unbounded, for a
    root the caller trusts).

    Raises:
        UnsafeCheckpointError: it decodes to more than ``max_bytes``.
        CheckpointCorruptError: an unknown transform, or bytes it cannot decode.
    """
    found = tuple(transforms)
    if not found:
        return raw
    if found != (ZSTD_DESCRIPTOR,):
        shown = ", ".join(t[:40] for t in found[:3])
        raise CheckpointCorruptError(path, f"unknown transforms: {shown}", item=item)
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        while True:
            want = (
                _CHUNK_BYTES if max_bytes is None else min(_CHUNK_BYTES, max_bytes + 1 - len(out))
            )
            chunk = reader.read(want)
            if not chunk:
                return out
            out += chunk
            if max_bytes is not None and len(out) > max_bytes:
                raise UnsafeCheckpointError(
                    path,
                    f"the item decompresses to more than the {max_bytes} bytes it may hold",
                    item=item,
                    because=_BOMB,
                )
    except zstandard.ZstdError as exc:
        raise CheckpointCorruptError(path, f"cannot decompress ({exc})", item=item) from None


def item_archive(
    data: bytes | bytearray | memoryview | Source,
    *,
    path: str,
    item: str,
    max_records: int,
    max_pickle_bytes: int | None = None,
) -> tuple[TorchArchive, bytes | memoryview]:
    """The checked archive of an item and its pickle (``data.pkl``).

    Raises:
        UnsafeCheckpointError: a compressed record, too many records, or a pickle over
            ``max_pickle_bytes``.
        CheckpointCorruptError: no such archive, no pickle, or saved big-endian.
    """
    source = MemorySource(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    archive = open_archive(source, path, item, max_records=max_records)
    order = archive.read("byteorder")
    if order is not None and (bytes(order) != b"little" or sys.byteorder != "little"):
        raise CheckpointCorruptError(path, "saved with another byte order", item=item)
    size = archive.size("data.pkl")
    if size is None:
        raise CheckpointCorruptError(path, "not a torch.save archive (no data.pkl)", item=item)
    if max_pickle_bytes is not None and size > max_pickle_bytes:
        raise UnsafeCheckpointError(
            path, f"the item's pickle is {size} bytes", item=item, because=_BOMB
        )
    pickled = archive.read("data.pkl")
    assert pickled is not None
    return archive, pickled


def decode_tensor_item(
    data: bytes | bytearray | memoryview | Source,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    path: str,
    item: str,
    materialize: bool = True,
) -> torch.Tensor:
    """The tensor a tensor item holds, which must be of the ``dtype`` and ``shape`` the
    metadata declares. ``materialize=False`` checks everything but reads no tensor bytes
    (deep verification) and returns a meta tensor.

    Raises:
        UnsafeCheckpointError: anything but a tensor made of the item's own records.
        CheckpointCorruptError: not a saved tensor, or another dtype or shape.
    """
    archive, pickled = item_archive(
        data,
        path=path,
        item=item,
        max_records=_TENSOR_MAX_RECORDS,
        max_pickle_bytes=_TENSOR_PICKLE_MAX_BYTES,
    )
    refused = scan(pickled, path, item, max_ops=TENSOR_MAX_OPS)
    if refused:
        raise UnsafeCheckpointError(
            path, f"the tensor's pickle uses {', '.join(sorted(refused))}", item=item
        )
    unpickler = ItemUnpickler(
        archive, pickled, path, item, plain_data=False, materialize=materialize
    )
    tensor = unpickler.load_checked("a saved tensor")
    if not isinstance(tensor, torch.Tensor) or not any(tensor is t for t in unpickler.built):
        raise CheckpointCorruptError(path, "not a saved tensor", item=item)
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise CheckpointCorruptError(
            path,
            "the stored tensor is not of the dtype and shape the metadata declares",
            item=item,
            expected=(str(dtype), list(shape)),
            actual=(str(tensor.dtype), list(tensor.shape)),
        )
    return tensor
