"""One ``torch.save`` file, written as a stream: the pickle first, then each tensor's bytes.

``torch.save`` needs every tensor in memory; its format (a zip of a pickle that rebuilds each
tensor from a storage record) does not. The pickle is exactly what ``Tensor.__reduce_ex__``
pickles, so ``torch.load(weights_only=True)`` loads the file; the constant records are learnt
from the running torch's own ``torch.save``, not hard-coded.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import struct
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from dcp_safe import layout
from dcp_safe.adapters.tensor_records import learnt_format
from dcp_safe.errors import ConfigError, StorageError
from dcp_safe.exporting.consolidate import Consolidator, NotPlainData
from dcp_safe.exporting.publish import Sha256Sink, StagedExport, write_tensor
from dcp_safe.exporting.selection import Selection, TensorEntry
from dcp_safe.torch_compat import TensorStub, legacy_storage_type, pickle_stubs

__all__ = ["TorchFileWriter", "holds", "is_plain", "write"]

_ZIP64_EXTRA = 20  # the zip64 field zipfile adds to a local header opened with force_zip64
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def holds(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` has a typed-storage class for the pickle."""
    return legacy_storage_type(dtype) is not None


def write(staged: StagedExport, source: Consolidator, selection: Selection) -> dict[str, str]:
    """Write ``model.pt`` of the selected tensors and the plain-data objects, checked by
    loading it back; the objects skipped (not plain data), each with the reason.

    Raises:
        ConfigError: the selection holds no tensors and no plain data.
        StorageError: a write failed, or ``torch.load`` finds other contents.
    """
    plain: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for key, value in source.objects(selection.objects).items():
        if isinstance(value, NotPlainData):
            skipped[key] = value.reason
        elif not is_plain(value):
            skipped[key] = f"not plain data ({type(value).__name__})"
        else:
            plain[key] = value
    if not selection.tensors and not plain:
        raise ConfigError("nothing to export: the selection holds no tensors and no plain data")
    with (
        staged.open(layout.TORCH_FILE) as sink,
        TorchFileWriter(sink, selection.tensors, plain) as writer,
    ):
        source.each_tensor(selection.tensors, writer.add)
    _check_file(staged.path(layout.TORCH_FILE), selection.tensors, plain)
    return skipped


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data that ``torch.load(weights_only=True)`` rebuilds:
    ``None``, numbers, strings, bytes, and lists, tuples and dicts of them."""
    if isinstance(value, _PLAIN):
        return True
    if type(value) in (list, tuple):
        return all(is_plain(item) for item in value)
    if type(value) in (dict, collections.OrderedDict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


class TorchFileWriter(contextlib.AbstractContextManager["TorchFileWriter"]):
    """Writes one ``torch.save``-format file of ``tensors`` (in order) and ``objects``.

    Call order: construct (writes the pickle), :meth:`add` once per tensor in the order given,
    :meth:`close`. As a context manager it closes on success and, on an exception, winds the
    archive down into a discarded sink (the caller throws the file away). The loaded file is
    a flat dict from key to tensor or object, in key order.

    Args:
        tensors: the tensors that :meth:`add` will be given, in that order.
        objects: plain-data entries (see :func:`is_plain`) by key.
    """

    def __init__(
        self, sink: Sha256Sink, tensors: Sequence[TensorEntry], objects: dict[str, Any]
    ) -> None:
        learnt = learnt_format()  # the records torch writes around a tensor's
        if learnt is None:
            raise ConfigError(
                "format='torch' does not know this torch's file layout; use safetensors"
            )
        self._format = learnt
        kinds = [(name.partition("/")[2], content) for name, content in learnt.records]
        data = next(i for i, (kind, _) in enumerate(kinds) if kind.startswith("data/"))
        self._sink = sink
        self._tensors = list(tensors)
        self._next = 0
        # No seek on the sink: zipfile writes each record front to back.
        self._zip = zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED, allowZip64=True)
        state: dict[str, Any] = dict(objects)
        for index, entry in enumerate(self._tensors):
            storage_type = legacy_storage_type(entry.out_dtype)
            assert storage_type is not None  # refused up front (holds)
            state[entry.key] = TensorStub(str(index), storage_type, entry.shape)
        self._record("data.pkl", pickle_stubs(dict(sorted(state.items()))))
        # Then the constant records before the data; those after it wait for close().
        self._after = [(kind, content) for kind, content in kinds[data:] if content is not None]
        for kind, content in kinds[:data]:
            if content is not None:
                self._record(kind, content)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
            return
        self._sink.discard()
        with contextlib.suppress(Exception):
            self._zip.close()  # else its finalizer would try, into a closed file

    def add(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        """Append the next tensor's record (cast to the entry's output dtype)."""
        if self._next >= len(self._tensors) or self._tensors[self._next].key != entry.key:
            raise ValueError(f"tensor {entry.key!r} out of order")  # a caller's bug
        name = f"{self._format.archive}/data/{self._next}"
        info = self._aligned(name, entry.out_nbytes)
        with self._zip.open(info, "w", force_zip64=True) as record:
            write_tensor(record, tensor, entry.out_dtype)
        self._next += 1

    def close(self) -> None:
        """Write the trailing records and the zip directory."""
        if self._next != len(self._tensors):
            raise ValueError("not every tensor was added")  # a caller's bug
        for kind, content in self._after:
            self._record(kind, content)
        serial = f"{secrets.randbits(128):040d}"[-40:]
        self._record(".data/serialization_id", serial.encode())
        self._zip.close()

    def _record(self, kind: str, content: bytes) -> None:
        name = f"{self._format.archive}/{kind}"
        with self._zip.open(self._aligned(name, len(content)), "w", force_zip64=True) as record:
            record.write(content)

    def _aligned(self, name: str, size: int) -> zipfile.ZipInfo:
        """A record whose data will start on the alignment torch uses (padding in an extra
        field of the local header, as torch pads)."""
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.file_size = size
        fixed = self._sink.tell() + 30 + len(name.encode()) + 4 + _ZIP64_EXTRA
        pad = -fixed % self._format.alignment
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return info


def _check_file(path: str, tensors: Sequence[TensorEntry], objects: dict[str, Any]) -> None:
    """Load a written file as a user will (``torch.load(weights_only=True)``, with ``mmap=True``
    so the tensor data is mapped, not read) and compare its keys, dtypes and shapes.

    Raises:
        StorageError: torch refuses the file or finds other contents.
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise StorageError("check", path, f"torch.load refuses the file: {exc}") from exc
    expected = {entry.key: (entry.out_dtype, entry.shape) for entry in tensors}
    found = {
        key: (value.dtype, tuple(value.shape))
        for key, value in loaded.items()
        if isinstance(value, torch.Tensor)
    }
    if found != expected or set(loaded) != set(expected) | set(objects):
        raise StorageError("check", path, "torch.load finds other contents than were written")
