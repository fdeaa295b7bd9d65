"""What a load would decode, checked the way a load decodes it: deep verification's last step.

Checksums do not prove decoding is safe (whoever writes the root re-checksums a planted pickle),
so DCP's metadata and every item go through the loads' own bounded decoders; an uncompressed
tensor item is checked in place, its tensor bytes not read again. An item is an object item
when its manifest record has no chunk offset, the same key a load uses, so no item a load would
unpickle escapes, whatever the metadata claims. With ``allow_pickle`` object items are not
decoded, and a checkpoint without plain metadata is skipped rather than unpickled.
"""

from __future__ import annotations

import itertools
from typing import Any, BinaryIO

import torch

from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.items import (
    OBJECT_MAX_DECODED_BYTES,
    decode_object,
    decode_tensor_item,
    decode_transforms,
    stored_tensors,
    tensor_item_bound,
)
from dcp_safe.checkpoints.metadata import read_dcp_metadata
from dcp_safe.checkpoints.torch_zip import StreamSource
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.schema import ItemRecord, Manifest
from dcp_safe.manifest.streams import read_verified

__all__ = ["check_loadable"]


def check_loadable(
    backend: Backend, name: str, manifest: Manifest, *, allow_pickle: bool = False
) -> int:
    """Raise unless DCP's metadata and every item of ``name`` decode as a load decodes them.

    Returns the number of object items checked. ``allow_pickle``: as in the module docstring.

    Raises:
        UnsafeCheckpointError: an object item refers to more than plain data, an item decodes
            past what the checkpoint declares, or (without ``allow_pickle``) the checkpoint
            has no plain metadata.
        CheckpointCorruptError: the metadata is malformed, or an item is not what it declares.
    """
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
                    _check_item(stream, path, item, tensors.get(item.key))
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "file is missing") from None
    return len(objects)


def _check_item(
    stream: BinaryIO, path: str, item: ItemRecord, tensor: tuple[torch.dtype, Any] | None
) -> None:
    """Decode one item as a load would, reading no tensor bytes: an object item when ``tensor``
    (its stored dtype and shape) is None; an uncompressed tensor item checked in place."""
    label = item.describe()
    data: Any
    if tensor is not None and not item.transforms:
        data = StreamSource(stream, item.start, item.length)
    else:
        bound = OBJECT_MAX_DECODED_BYTES if tensor is None else tensor_item_bound(*tensor)
        raw = read_verified(
            stream,
            path=path,
            item=label,
            start=item.start,
            length=item.length,
            checksum=item.checksum,
        )
        data = decode_transforms(raw, item.transforms, max_bytes=bound, path=path, item=label)
    if tensor is None:
        decode_object(data, path, label, materialize=False)
    else:
        decode_tensor_item(
            data, dtype=tensor[0], shape=tensor[1], path=path, item=label, materialize=False
        )
