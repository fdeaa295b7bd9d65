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

  One entry type DCP documents for opaque bytes, ``io.BytesIO``, is pickled by DCP as the
  object itself (``torch.save(BytesIO)``), which the weights-only unpickler refuses. Such an
  item is decoded by :class:`_BytesIOUnpickler`, which admits exactly what ``torch.save`` writes
  for one (the class, its bytes as latin-1 text, its position) and rebuilds a new ``BytesIO``
  from the bytes: no general unpickler, no attribute of any class set from storage.

Anything else raises :class:`~dcp_safe.errors.UnsafeCheckpointError` naming the file, the item
and the global that was refused, unless the caller trusts the root (``allow_pickle=True``).

It lives in this layer, below the DCP adapters, so that deep verification
(:mod:`dcp_safe.checkpoints.loadable`) applies the very checks a load applies;
:mod:`dcp_safe.dcp.unpickle` is the name the readers import it by.
"""

from __future__ import annotations

import io
import pickle
import zipfile
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
        value = _bytes_io(payload.getvalue())
        if value is None:
            raise UnsafeCheckpointError(
                path,
                f"the object is not plain data ({str(exc).splitlines()[0]})",
                item=item,
            ) from None
    clean = io.BytesIO()
    torch.save(value, clean)
    clean.seek(0)
    return clean


class _BytesIOState:
    """What NEWOBJ makes of ``_io.BytesIO`` here: a holder whose BUILD takes only
    ``(bytes, position, None or {})`` (a BytesIO's own state), never attributes."""

    value: bytes = b""
    position: int = 0

    def __setstate__(self, state: object) -> None:
        if not (isinstance(state, tuple) and len(state) == 3):
            raise pickle.UnpicklingError("a BytesIO's state is (bytes, position, dict)")
        value, position, extra = state
        if not isinstance(value, bytes) or not isinstance(position, int) or extra:
            raise pickle.UnpicklingError("a BytesIO's state is (bytes, position, no attributes)")
        self.value, self.position = value, max(0, min(position, len(value)))


def _latin1(text: object, encoding: object) -> bytes:
    """``_codecs.encode`` as protocol 2 pickles bytes: ``encode(str, "latin1")``, nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("only latin-1 text may be encoded to bytes here")
    return text.encode("latin1")


class _BytesIOUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_io", "BytesIO"):
            return _BytesIOState
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a pickled BytesIO")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a pickled BytesIO holds no storage")


def _bytes_io(raw: bytes) -> io.BytesIO | None:
    """The ``io.BytesIO`` that ``torch.save(BytesIO)`` wrote into ``raw``; ``None`` if it is not
    exactly that (a torch zip whose pickle is one BytesIO)."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1 or archive.getinfo(pickles[0]).compress_type != 0:
                return None  # torch writes its records STORED: nothing here inflates
            found = _BytesIOUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
    except (pickle.UnpicklingError, zipfile.BadZipFile, ValueError, EOFError, TypeError):
        return None
    if not isinstance(found, _BytesIOState):
        return None
    stream = io.BytesIO(found.value)
    stream.seek(found.position)
    return stream
