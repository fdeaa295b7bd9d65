"""Loading what a checkpoint pickled, without running code from storage.

Whoever can write to a checkpoint root must not get code execution in every process that loads
from it, and checksums do not help (the same writer computes them). Two things in a DCP
checkpoint are pickles:

* ``.metadata``, DCP's global metadata: read here through an unpickler that admits only DCP's
  metadata classes, ``torch.Size``, torch dtypes and layouts (the globals a real ``.metadata``
  holds, measured from plain, optimizer, DTensor and zstd checkpoints), and nothing else.
* non-tensor items (``BYTE_IO``): DCP's ``DefaultLoadPlanner.load_bytes`` calls
  ``torch.load(weights_only=False)`` on them. :func:`sanitized_object_stream` first loads the
  bytes with torch's weights-only unpickler (plain containers, numbers, strings, tensors), then
  hands the planner a stream *re-serialized from that safe object*, so whatever the planner
  does with it, it can only rebuild what was already admitted.

Anything else raises :class:`~dcp_safe.errors.UnsafeCheckpointError` naming the file, the item
and the global that was refused, unless the caller trusts the root (``allow_pickle=True``).

It lives in this layer, below the DCP adapters, so that deep verification
(:mod:`dcp_safe.checkpoints.loadable`) applies the very checks a load applies;
:mod:`dcp_safe.dcp.unpickle` is the name the readers import it by.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from dcp_safe.errors import UnsafeCheckpointError

__all__ = ["load_metadata", "sanitized_object_stream"]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a layout by its name, from a fixed table
        ("torch", "Size"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, path: str) -> None:
        super().__init__(io.BytesIO(raw))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            self._path,
            f"DCP metadata refers to {module}.{name}, which is not a DCP metadata type",
        )


def load_metadata(raw: bytes, path: str, *, allow_pickle: bool = False) -> Any:
    """DCP's ``Metadata`` from the bytes of ``.metadata``.

    Raises:
        UnsafeCheckpointError: it refers to a global outside DCP's metadata types.
        CheckpointCorruptError: it is not a pickle at all (via the caller's mapping).
    """
    if allow_pickle:
        return pickle.loads(raw)  # the caller trusts this root
    return _MetadataUnpickler(raw, path).load()


def sanitized_object_stream(
    payload: io.BytesIO, path: str, item: str, *, allow_pickle: bool = False
) -> io.BytesIO:
    """A stream the planner may ``torch.load`` as it likes: re-serialized from a safe load.

    Raises:
        UnsafeCheckpointError: the item holds something the weights-only unpickler refuses.
    """
    if allow_pickle:
        return payload
    try:
        value = torch.load(payload, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            path,
            f"the object is not plain data ({str(exc).splitlines()[0]})",
            item=item,
        ) from None
    clean = io.BytesIO()
    torch.save(value, clean)
    clean.seek(0)
    return clean
