"""The staged state on its way to the checkpoint worker, and errors and checks on their way back.

A staged tensor crosses as its place in a slab and its layout, rebuilt over the same memory in
the worker (docs/staging.md, "The transport"). A poisoned state (a rank's refused staging,
:mod:`dcp_safe.staging.poison`) crosses as its error, so that the worker's save raises it inside
the planning collective and every rank's worker learns of it.

The check a new checkpoint passes before the manager trusts it (:func:`check_commit`) runs where
the save ran: on the manager's thread with the thread executor; in the worker, right after the
commit (a node-local save: after its remote commit), so that the training process parses no
manifest of its own saves (at 10,000 items ~0.3 s of Python taken from the training thread). The
worker sends back what it found as a :class:`Checked`; the parent keeps the header, so its
retention lists the new checkpoint without parsing it either.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.checkpoints.catalog import verify_opened
from dcp_safe.checkpoints.committed import (
    CommittedHeader,
    check_signed,
    open_committed,
    remember_header,
)
from dcp_safe.errors import WorkerError, portable, restored
from dcp_safe.staging.poison import FailedStaging
from dcp_safe.staging.shared import SharedSlabs

# The worker's maps of the parent's slabs, by slab id.
_MAPS: dict[int, mmap.mmap] = {}


_Reduction = tuple[Any, tuple[Any, ...]]


class StateEncoder:
    """Pickles staged states whose tensors live in ``slabs``, by place.

    A tensor's reduction is remembered while the tensor lives: the pool hands the same typed
    views to every save of one layout, so from the second save on a tensor costs one lookup on
    the sending thread (10,000 tensors: ~20 ms instead of ~250 ms of the GIL).
    """

    def __init__(self, slabs: SharedSlabs) -> None:
        self.slabs = slabs
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], _Reduction]] = {}

    def dump(self, state_dict: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        _StatePickler(out, self).dump(state_dict)
        return out.getvalue()

    def reduction(self, tensor: torch.Tensor) -> _Reduction | None:
        key = id(tensor)
        known = self._known.get(key)
        if known is not None and known[0]() is tensor:
            return known[1]
        place = self.slabs.place_of(tensor)
        if place is None:
            return None
        where = (place.slab, place.offset, place.nbytes)
        layout = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
        reduction: _Reduction = (_tensor_at, (where, layout))
        # Forgotten as the tensor dies, before its id can be another's.
        ref = weakref.ref(tensor, lambda _: self._known.pop(key, None))
        self._known[key] = (ref, reduction)
        return reduction


class _StatePickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, encoder: StateEncoder) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._encoder = encoder

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not obj.is_cuda:
            reduction = self._encoder.reduction(obj)
            if reduction is not None:
                return reduction
        elif type(obj) is FailedStaging:  # its own reduction raises, by design
            error = WorkerError(type(obj.error).__name__, str(obj.error))
            return (_failed_staging, (portable(obj.error, error),))
        return NotImplemented


def _failed_staging(data: bytes) -> FailedStaging:
    # What the reducer above sent: a staging's error (an Exception), or a WorkerError.
    return FailedStaging(cast(Exception, decode_error(data)))


def map_slab(slab: int, fd: int, size: int) -> None:  # in the worker; closes fd
    try:
        _MAPS[slab] = mmap.mmap(fd, size)
    finally:
        os.close(fd)


def forget_slab(slab: int) -> None:  # in the worker: unmapped once no tensor views it
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
    fallback = WorkerError(type(error).__name__, str(error), text)
    with contextlib.suppress(Exception):  # it takes no note: sent as its text, below
        error.add_note(f"in the checkpoint worker (pid {os.getpid()}):\n{text}")
        return portable(error, fallback)
    return pickle.dumps(fallback)


def decode_error(data: bytes) -> BaseException:  # a WorkerError if it cannot be rebuilt here
    return restored(
        data,
        lambda exc: WorkerError(
            type(exc).__name__, f"an error the parent could not rebuild: {exc}"
        ),
    )


@dataclass(frozen=True)
class Checked:
    """A new checkpoint's check, as the worker reports it: its error (:func:`encode_error`;
    ``None``: it passed), or the manifest digest it read and that manifest's header."""

    error: bytes | None = None
    digest: str = ""
    header: CommittedHeader | None = None

    def remember(self) -> None:  # this process lists it without parsing its manifest again
        if self.header is not None:
            remember_header(self.digest, self.header)


def check_commit(
    writer: SafeStorageWriter, name: str, *, deep: bool
) -> tuple[str, CommittedHeader]:
    """Check ``name``, committed through ``writer``: its marker and manifest (and signature,
    with a signing writer), or with ``deep`` every byte; its manifest digest and header.

    Raises:
        CheckpointCorruptError: the checkpoint does not hold what its manifest says
            (``SignatureError`` / ``UnsignedCheckpointError``: not signed with the key).
        CheckpointNotFoundError: no commit marker.
        OSError: storage failed.
    """
    backend, key = writer.commit_backend, writer.options.signing_key
    opened = open_committed(backend, name)  # its marker and manifest, read once
    if deep:
        verify_opened(backend, opened, signing_key=key)
    elif key is not None:
        check_signed(backend, opened, key)
    return opened.digest, CommittedHeader.of(opened.manifest)
