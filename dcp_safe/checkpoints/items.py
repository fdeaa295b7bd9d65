"""One item's bytes to what it holds, bounded by what the checkpoint declares for it, without
running code from storage (threat model: docs/integrity.md, "Loading never runs code from the
checkpoint").

Three steps, each bounded before it allocates: its transforms (zstd inflated in chunks, no
further than the item may hold), its ``torch.save`` archive
(:mod:`dcp_safe.checkpoints.torch_zip`), its pickle (:mod:`dcp_safe.checkpoints.item_pickles`).
The reader and deep verification both decode through here, so what verifies is what loads.
Plain tensors laid out exactly as ``torch.save`` writes them never come here
(:mod:`dcp_safe.reading.tensors`). DCP's planner is handed an object item re-serialized from
its safe decode, so it can only rebuild what was admitted; a pickled ``io.BytesIO`` has an
exact decoder of its own.

Deep verification's last step (:func:`check_loadable`): checksums do not prove decoding is safe
(whoever writes the root re-checksums a planted pickle), so DCP's metadata and every item go
through these decoders; an uncompressed tensor item is checked in place, its tensor bytes not
read again. An item is an object item when its manifest record has no chunk offset, the same key
a load uses, so no item a load would unpickle escapes, whatever the metadata claims. With
``allow_pickle`` object items are not decoded, and a checkpoint without plain metadata is
skipped rather than unpickled.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
import sys
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch
import zstandard
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.item_pickles import (
    OBJECT_MAX_OPS,
    TENSOR_MAX_OPS,
    ItemUnpickler,
    Shadows,
    is_stand_in,
    latin1,
    refused_globals,
    scan,
)
from dcp_safe.checkpoints.metadata import read_dcp_metadata
from dcp_safe.checkpoints.torch_zip import (
    MAX_RECORDS,
    MemorySource,
    Source,
    StreamSource,
    open_archive,
)
from dcp_safe.errors import CheckpointCorruptError, UnsafeCheckpointError
from dcp_safe.manifest.schema import ItemKey, ItemRecord, Manifest, item_key
from dcp_safe.manifest.streams import read_verified
from dcp_safe.torch_compat import ZStandard

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
_Bytes = bytes | bytearray | memoryview
_BOMB = "decoding it would take more memory than the checkpoint declares for it"


def stored_tensors(metadata: Metadata | None) -> dict[ItemKey, tuple[torch.dtype, tuple[int, ...]]]:
    """Each stored tensor chunk's dtype and shape, by its manifest item key."""
    entries = {} if metadata is None else metadata.state_dict_metadata
    return {
        item_key(fqn, chunk.offsets): (entry.properties.dtype, tuple(int(s) for s in chunk.sizes))
        for fqn, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata)
        for chunk in entry.chunks
    }


def tensor_item_bound(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """The most bytes a stored tensor of ``dtype`` and ``shape`` decodes to (the metadata's
    decoder has bounded its sizes against the item already)."""
    return math.prod(shape) * max(1, dtype.itemsize) + TENSOR_ARCHIVE_BYTES


def decode_transforms(
    raw: _Bytes, transforms: Iterable[str], *, max_bytes: int | None, path: str, item: str
) -> _Bytes:
    """``raw`` with its transforms undone, at most ``max_bytes`` (``None``: unbounded, for a
    root the caller trusts; more: UnsafeCheckpointError). CheckpointCorruptError: an unknown
    transform, or bytes it cannot decode."""
    found = tuple(transforms)
    if not found:
        return raw
    if found != (ZSTD_DESCRIPTOR,):
        shown = ", ".join(t[:40] for t in found[:3])
        raise CheckpointCorruptError(path, f"unknown transforms: {shown}", item=item)
    out, limit = bytearray(), sys.maxsize if max_bytes is None else max_bytes
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        while chunk := reader.read(min(_CHUNK_BYTES, limit + 1 - len(out))):
            out += chunk
            if len(out) > limit:
                why = f"the item decompresses to more than the {max_bytes} bytes it may hold"
                raise UnsafeCheckpointError(path, why, item=item, because=_BOMB)
    except zstandard.ZstdError as exc:
        raise CheckpointCorruptError(path, f"cannot decompress ({exc})", item=item) from None
    return out


def _unpickler(
    data: _Bytes | Source, path: str, item: str, *, plain_data: bool, materialize: bool
) -> ItemUnpickler | io.BytesIO:
    """The unpickler of an item's checked archive and scanned pickle (``data.pkl``): an object
    item's (``plain_data``) or a tensor item's, each with its bounds; for an object item that is
    a pickled ``BytesIO``, that ``BytesIO``. UnsafeCheckpointError: a compressed record, too
    many records or opcodes, a tensor's pickle over its size, or a refused opcode;
    CheckpointCorruptError: no such archive, no pickle, or saved big-endian."""
    source = MemorySource(data) if isinstance(data, _Bytes) else data
    max_records = MAX_RECORDS if plain_data else _TENSOR_MAX_RECORDS
    archive = open_archive(source, path, item, max_records=max_records)
    order = archive.read("byteorder")
    if order is not None and (bytes(order) != b"little" or sys.byteorder != "little"):
        raise CheckpointCorruptError(path, "saved with another byte order", item=item)
    size = archive.size("data.pkl")
    if size is None:
        raise CheckpointCorruptError(path, "not a torch.save archive (no data.pkl)", item=item)
    if not plain_data and size > _TENSOR_PICKLE_MAX_BYTES:
        raise UnsafeCheckpointError(
            path, f"the item's pickle is {size} bytes", item=item, because=_BOMB
        )
    pickled = archive.read("data.pkl")
    assert pickled is not None
    refused = scan(pickled, path, item, max_ops=OBJECT_MAX_OPS if plain_data else TENSOR_MAX_OPS)
    found = _bytes_io(pickled) if plain_data and refused and refused <= _BYTES_IO_OPS else None
    if found is not None:
        return found
    if refused:
        uses = f"pickle uses {', '.join(sorted(refused))}"
        reason = (
            f"the object is not plain data (its {uses})" if plain_data else f"the tensor's {uses}"
        )
        raise UnsafeCheckpointError(path, reason, item=item)
    return ItemUnpickler(
        archive, pickled, path, item, plain_data=plain_data, materialize=materialize
    )


def decode_tensor_item(
    data: _Bytes | Source,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    path: str,
    item: str,
    materialize: bool = True,
) -> torch.Tensor:
    """The tensor a tensor item holds, which must be of the ``dtype`` and ``shape`` the
    metadata declares (else CheckpointCorruptError, as for anything but a saved tensor; one not
    made of the item's own records: UnsafeCheckpointError). ``materialize=False`` checks
    everything but reads no tensor bytes (deep verification) and returns a meta tensor."""
    unpickler = _unpickler(data, path, item, plain_data=False, materialize=materialize)
    assert isinstance(unpickler, ItemUnpickler)  # a BytesIO only for an object item
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


#: The deepest nesting of containers an object item may hold (honest states: a handful).
MAX_NESTING = 100
_CONTAINERS = (dict, list, tuple, set, frozenset)

# What torch.save writes for a BytesIO and nothing else may use.
_BYTES_IO_OPS = frozenset(("NEWOBJ", "BUILD"))


def decode_object(data: _Bytes, path: str, item: str, *, materialize: bool = True) -> Any:
    """The value an object item holds (after its transforms), decoded without running code;
    ``materialize=False`` (deep verification) checks tensors in it without reading their bytes
    (they come back as meta tensors). UnsafeCheckpointError: more than plain data and its own
    tensors, or over the opcode or record budget; CheckpointCorruptError: not something
    ``torch.save`` wrote."""
    unpickler = _unpickler(data, path, item, plain_data=True, materialize=materialize)
    if isinstance(unpickler, io.BytesIO):
        return unpickler
    value = unpickler.load_checked("a saved object")
    _check_depth(value, path, item)
    return value


def _check_depth(value: object, path: str, item: str) -> None:
    """Refuse containers nested deeper than :data:`MAX_NESTING`, or in a cycle. Unpickling
    builds any depth without recursion, but a load hands DCP a re-serialized copy and pickling
    recurses: a 500-deep list passed deep verification and failed every load with
    ``RecursionError``. A walk without recursion, each shared container once."""
    heights: dict[int, int] = {}  # containers walked: their nesting depth
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, done = stack.pop()
        if not isinstance(node, _CONTAINERS) or (not done and id(node) in heights):
            continue
        members = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        inner = [c for c in members if isinstance(c, _CONTAINERS)]  # a dict's keys and values
        if done:
            on_path.discard(id(node))
            heights[id(node)] = 1 + max((heights[id(c)] for c in inner), default=0)
            if heights[id(node)] > MAX_NESTING:
                why = f"the object nests containers more than {MAX_NESTING} levels deep"
                because = "copying it for the load would exhaust the stack"
                raise UnsafeCheckpointError(path, why, item=item, because=because)
        elif any(id(c) in on_path for c in inner):
            raise UnsafeCheckpointError(
                path, "the object contains itself", item=item, because="it nests without end"
            )
        else:
            on_path.add(id(node))
            stack.append((node, True))
            stack += [(c, False) for c in inner if id(c) not in heights]


def sanitized_object_stream(
    payload: io.BytesIO | _Bytes, path: str, item: str, *, allow_pickle: bool = False
) -> io.BytesIO:
    """A stream the planner may ``torch.load`` as it likes: re-serialized from a safe decode
    (errors as :func:`decode_object`'s)."""
    if allow_pickle:
        return payload if isinstance(payload, io.BytesIO) else io.BytesIO(payload)
    data = payload.getbuffer() if isinstance(payload, io.BytesIO) else payload
    try:
        value = decode_object(data, path, item)
    finally:
        del data  # a BytesIO cannot grow while a view of it lives
    clean = io.BytesIO()
    torch.save(value, clean)
    clean.seek(0)
    return clean


def _bytes_io(pickled: bytes | memoryview) -> io.BytesIO | None:
    """The ``io.BytesIO`` that ``torch.save(BytesIO)`` pickled as ``pickled`` (an archive's
    checked ``data.pkl``): made of stand-ins, it must name ``_io.BytesIO`` (and, as protocol 2
    pickles bytes, ``_codecs.encode``) only, and its state be a BytesIO's own ``(bytes,
    position, None or {})``, never attributes; ``None`` if it is not exactly that."""
    shadows = Shadows(pickled)
    try:
        found = shadows.load()
    except Exception:  # whatever a malformed pickle makes the unpickler raise
        return None
    if set(shadows.stands) - {("_io", "BytesIO"), ("_codecs", "encode")}:
        return None
    state = found.state if is_stand_in(found, "_io.BytesIO") and not found.args else None
    if not (isinstance(state, tuple) and len(state) == 3):
        return None
    value, position, extra = state
    if is_stand_in(value, "_codecs.encode"):
        try:
            value = latin1(*value.args)
        except (TypeError, pickle.UnpicklingError):
            return None
    if not isinstance(value, bytes) or not isinstance(position, int) or extra:
        return None
    stream = io.BytesIO(value)
    stream.seek(max(0, min(position, len(value))))
    return stream


def check_loadable(
    backend: Backend,
    name: str,
    manifest: Manifest,
    *,
    allow_pickle: bool,
    classes: set[str] | None = None,
) -> int:
    """Raise unless DCP's metadata and every item of ``name`` decode as a load decodes them
    (UnsafeCheckpointError: an object item refers to more than plain data, an item decodes past
    what the checkpoint declares, or, without ``allow_pickle``, the checkpoint has no plain
    metadata; CheckpointCorruptError: malformed metadata, or an item not what it declares); the
    number of object items checked. ``allow_pickle``: as in the module docstring. ``classes``:
    an object item refused for the classes it needs adds their names to it (those a load's
    unpickler refuses) and the check goes on, so that all of them can be named."""
    if allow_pickle and manifest.dcp_metadata is None:
        return 0
    metadata = read_dcp_metadata(backend, name, manifest, allow_pickle=allow_pickle)
    tensors = stored_tensors(metadata)
    # An object item is what a load hands to DCP's load_bytes (unpickled).
    objects = [] if allow_pickle else [item for item in manifest.items if item.offset is None]
    checked = [item for item in manifest.items if item.key in tensors] + objects
    ordered = sorted(checked, key=lambda i: (i.file, i.start))
    for file_name, group in itertools.groupby(ordered, key=lambda i: i.file):
        rel = f"{name}/{file_name}"
        path = backend.full_path(rel)
        try:
            with backend.open_read(rel) as stream:
                for item in group:
                    _check_item(stream, path, item, tensors.get(item.key), classes)
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "file is missing") from None
    return len(objects)


def _check_item(
    stream: BinaryIO,
    path: str,
    item: ItemRecord,
    tensor: tuple[torch.dtype, Any] | None,
    classes: set[str] | None,
) -> None:
    """Decode one item as a load would, reading no tensor bytes: an object item when ``tensor``
    (its stored dtype and shape) is None; an uncompressed tensor item checked in place."""
    label = item.describe()
    data: Any
    if tensor is not None and not item.transforms:
        data = StreamSource(stream, item.start, item.length)
    else:
        bound = OBJECT_MAX_DECODED_BYTES if tensor is None else tensor_item_bound(*tensor)
        raw = read_verified(stream, path, label, item.start, item.length, item.checksum)
        data = decode_transforms(raw, item.transforms, max_bytes=bound, path=path, item=label)
    if tensor is not None:
        decode_tensor_item(
            data, dtype=tensor[0], shape=tensor[1], path=path, item=label, materialize=False
        )
        return
    try:
        decode_object(data, path, label, materialize=False)
    except UnsafeCheckpointError:
        if classes is None:
            raise
        needed = refused_globals(data, path, label)
        if not needed:
            raise
        classes.update(needed)
