"""The staged state on its way to the checkpoint worker, and errors on their way back.

A staged tensor crosses as where its bytes are (:class:`~dcp_safe.staging.shared.Place`) plus its
dtype, shape and strides: the worker maps the slabs once (:func:`map_slab`) and rebuilds each
tensor over the same memory, so no byte is copied and no descriptor is sent per tensor. Anything
else in the state (step counters, RNG states) is pickled as it is.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import traceback
from typing import Any

import torch

from dcp_safe.errors import WorkerError
from dcp_safe.staging.shared import SharedSlabs

__all__ = ["decode_error", "dump_state", "encode_error", "forget_slab", "map_slab"]

# The worker's maps of the parent's slabs, by slab id.
_MAPS: dict[int, mmap.mmap] = {}


class _StatePickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, slabs: SharedSlabs) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._slabs = slabs

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu":
            place = self._slabs.place_of(obj)
            if place is not None:
                where = (place.slab, place.offset, place.nbytes)
                layout = (obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())
                return _tensor_at, (where, layout)
        return NotImplemented


def dump_state(state_dict: dict[str, Any], slabs: SharedSlabs) -> bytes:
    """``state_dict`` pickled, its tensors in ``slabs`` by place, not by value."""
    out = io.BytesIO()
    _StatePickler(out, slabs).dump(state_dict)
    return out.getvalue()


def map_slab(slab: int, fd: int, size: int) -> None:
    """In the worker: map slab ``slab`` from ``fd`` (closed here)."""
    try:
        _MAPS[slab] = mmap.mmap(fd, size)
    finally:
        os.close(fd)


def forget_slab(slab: int) -> None:
    """In the worker: unmap a slab the parent closed (once no tensor views it)."""
    _MAPS.pop(slab, None)


def _tensor_at(
    where: tuple[int, int, int], layout: tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]
) -> torch.Tensor:
    slab, offset, nbytes = where
    dtype, shape, stride, storage_offset = layout
    buffer = torch.frombuffer(_MAPS[slab], dtype=torch.uint8, count=nbytes, offset=offset)
    return torch.empty(0, dtype=dtype).set_(buffer.untyped_storage(), storage_offset, shape, stride)


def encode_error(error: BaseException) -> bytes:
    """``error`` pickled with its worker traceback as a note; a :class:`WorkerError` carrying
    its text when it does not survive pickling."""
    text = "".join(traceback.format_exception(error))
    try:
        error.add_note(f"in the checkpoint worker (pid {os.getpid()}):\n{text}")
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(WorkerError(type(error).__name__, str(error), text))


def decode_error(data: bytes) -> BaseException:
    """The error the worker sent (a :class:`WorkerError` if it cannot be rebuilt here)."""
    try:
        error = pickle.loads(data)
    except Exception as exc:
        return WorkerError(type(exc).__name__, f"an error the parent could not unpickle: {exc}")
    if not isinstance(error, BaseException):
        return WorkerError(type(error).__name__, repr(error))
    return error
