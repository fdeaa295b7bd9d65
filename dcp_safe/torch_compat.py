"""Every private torch API dcp_safe uses, in one place, each with why and what happens without it.

dcp_safe claims torch >= 2.13 and CI runs one torch; names that start with ``_`` can change in
any release. Keeping them here means one module to read when torch moves, and a test
(``tests/test_architecture.py``) keeps them from spreading. Where a fallback exists, it is here
too, so callers see one stable function.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import io
import logging
import math
import pickle
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import serialization

# DCP's helper for narrowing a stored tensor to a load request, and its stream-transform
# extension (zstd as a transform descriptor in .metadata): public in behaviour, private in name.
# No fallback: without them a zstd checkpoint could not be read by torch's readers.
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint._extension import ZStandard

# DCP's reader set-up and its load before the Stateful hand-over: ``dcp.load`` is these two
# (``dcp_load_state_dict`` below) plus that hand-over, and dcp_safe.load sends the entries read
# once between them (adapters/api.py). No fallback: with several ranks dcp_safe.load needs
# them.
from torch.distributed.checkpoint._storage_utils import _storage_setup as storage_setup
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

# The per-file entry of DCP's own ``.metadata`` storage map; writing it ourselves keeps the
# checkpoint loadable by torch's FileSystemReader.
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# DCP's method logger, which torch sets to DEBUG (dcp_debug_logs_unheard).
from torch.distributed.checkpoint.logger import _dcp_logger

# The ``WriteItem``s DCP's default save planner makes for one flattened entry (a tensor, a
# DTensor's local chunks, or an object's byte item): what the manager's in-memory tier needs to
# name each stored item of a kept copy as the writer did, without planning the whole state
# again. No fallback: it has had this name and signature since 2.2.
from torch.distributed.checkpoint.planner_helpers import (
    _create_write_items as create_write_items,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_state_dict
from torch.distributed.checkpoint.stateful import Stateful

# The default process group's key-value store (a ``dist.Store``). The manager meets its peers
# there when the wait may outlast a collective's deadline (a coalesced save starts once every
# rank finished its previous one): a store ``wait`` that times out breaks nothing, where a gloo
# collective that times out breaks its group. No fallback: without it the manager cannot
# coalesce across ranks.
from torch.distributed.distributed_c10d import _get_default_store as default_store
from torch.distributed.tensor import DTensor

# Storage class names as torch.save writes them (torch.FloatStorage for float32).
from torch.storage import _dtype_to_storage_type_map

# Re-exported from torch for the modules that need them (the rest is defined here).
__all__ = ["CURRENT_DCP_VERSION", "StorageInfo", "ZStandard", "dcp_load_state_dict"]
__all__ += ["create_write_items", "default_store", "narrow_tensor_by_index", "storage_setup"]

# ``Tensor._version`` is the autograd version counter every in-place update bumps; its C getter
# mapped over a list costs about 0.1 us a tensor (the mutation guard's whole cost).
read_version = torch.Tensor._version.__get__  # type: ignore[attr-defined]


@contextlib.contextmanager
def dcp_debug_logs_unheard() -> Iterator[None]:
    """While nobody would hear them, keep DCP from making its per-key DEBUG log records.

    DCP's save wraps ``_stateful_to_state_dict`` per top-level key in its method logger, whose
    logger torch sets to DEBUG: two records a key (start, end), built in full (caller lookup,
    message dict) before the handlers drop them: 56 us a key, 0.56 s on the caller's thread for
    a flat state of 10,000 keys. When no handler on the logger's chain takes DEBUG records
    (torch's own is a NullHandler; the root logger's default has none), its level is raised
    for the call. A handler that does listen (a user's, pytest's capture) keeps every record.
    """
    if _dcp_logger.level != logging.DEBUG or _dcp_debug_heard():
        yield
        return
    _dcp_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        _dcp_logger.setLevel(logging.DEBUG)


def _dcp_debug_heard() -> bool:
    if not _dcp_logger.isEnabledFor(logging.DEBUG):
        return False
    current: logging.Logger | None = _dcp_logger
    while current is not None:
        for handler in current.handlers:
            if not isinstance(handler, logging.NullHandler) and handler.level <= logging.DEBUG:
                return True
        current = current.parent if current.propagate else None
    return False


def dtensor_local(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local shard, as it is (``to_local()`` would add an autograd node)."""
    return tensor._local_tensor


def dtensor_chunks(tensor: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Where this rank's shard (or replica) sits in the global tensor: ``(offsets, sizes)``.

    ``__create_chunk_list__`` is the dunder DCP itself plans with; untyped in torch.
    """
    chunks = tensor.__create_chunk_list__()  # type: ignore[no-untyped-call]
    return [(tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in chunks]


def rebuild_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor over ``local`` with ``like``'s spec (mesh, placements, global shape, stride).

    The constructor, not ``from_local``: ``from_local`` moves a CPU shard back to the mesh's
    device.
    """
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[no-untyped-call]


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``tensor``'s storage."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def empty_host_cache() -> None:
    """Give freed pinned blocks in torch's caching host allocator back (no-op where absent)."""
    getattr(torch._C, "_host_emptyCache", lambda: None)()


# Whether torch's private ``_save`` has the signature save_tensor_without_crc knows.
_PRIVATE_SAVE = hasattr(serialization, "_get_storage_alignment") and list(
    inspect.signature(getattr(serialization, "_save", lambda: None)).parameters
) == ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


# Quantized storages are left out: they need a quantizer to mean anything, and their tensors
# reduce another way.
_STORAGE_NAMES = {
    dtype: name for dtype, name in _dtype_to_storage_type_map().items() if not name.startswith("Q")
}


def legacy_storage_type(dtype: torch.dtype) -> type | None:
    """The typed-storage class ``torch.save`` names in a tensor's pickle (``torch.FloatStorage``
    for float32), or ``None`` for dtypes it pickles another way (float8, uint16, quantized).

    :mod:`dcp_safe.adapters.tensor_records` writes and recognises ``torch.save``'s exact bytes for
    these; any other dtype goes through ``torch.save``/``torch.load`` themselves.
    """
    storage_type = getattr(torch, _STORAGE_NAMES.get(dtype, ""), None)
    return storage_type if isinstance(storage_type, type) else None


# What ``Tensor.__reduce_ex__`` names as the function that rebuilds a plain CPU tensor.
rebuild_tensor = torch._utils._rebuild_tensor_v2


class TensorStub:
    """Pickles as ``Tensor.__reduce_ex__`` does a contiguous, offset-0, no-grad CPU tensor of
    ``shape`` whose storage (``storage_type``) ``torch.save`` files as record ``data/<key>``:
    ``data.pkl`` written by :func:`pickle_stubs` without the tensor at hand."""

    def __init__(self, key: str, storage_type: type, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.storage = _StubStorage(("storage", storage_type, key, "cpu", math.prod(shape)))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        shape = self.shape
        stride = tuple(math.prod(max(n, 1) for n in shape[at + 1 :]) for at in range(len(shape)))
        return (rebuild_tensor, (self.storage, 0, shape, stride, False, collections.OrderedDict()))


class _StubStorage:
    def __init__(self, persistent: tuple[Any, ...]) -> None:
        self.persistent = persistent


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.persistent if isinstance(obj, _StubStorage) else None


def pickle_stubs(obj: Any) -> bytes:
    """``obj`` pickled as ``torch.save`` pickles it (protocol 2), each :class:`TensorStub` as
    the tensor it stands for, its storage a persistent id."""
    out = io.BytesIO()
    _StubPickler(out, protocol=2).dump(obj)
    return out.getvalue()


#: The globals ``torch.save`` names in the pickle of a plain tensor (v2: a typed storage; v3:
#: bytes and a dtype, for dtypes without a typed storage class) or a parameter, and what each
#: does. dcp_safe's item decoder (:mod:`dcp_safe.checkpoints.item_pickles`) implements these
#: itself, building tensors from the item's own records only; it never calls torch's.
TENSOR_REBUILDERS: dict[tuple[str, str], str] = {
    ("torch._utils", "_rebuild_tensor_v2"): "tensor_v2",
    ("torch._utils", "_rebuild_tensor_v3"): "tensor_v3",
    ("torch._utils", "_rebuild_parameter"): "parameter",
}
#: Where ``torch.save`` names storage classes in a persistent id (``torch.FloatStorage``,
#: ``torch.storage.UntypedStorage``).
STORAGE_MODULES = ("torch", "torch.storage")
#: The private globals a stock ``.metadata`` pickle names, as ``module.name``: the storage map's
#: entry, and what ``TensorProperties`` rebuilds its layout and memory format with. Adoption
#: (:mod:`dcp_safe.checkpoints.adopt`) reads them as stand-ins and never calls them; a torch that
#: pickles others makes adoption refuse, naming them.
DCP_STORAGE_INFO, DCP_LAYOUT, DCP_MEMORY_FORMAT = (
    f"{hook.__module__}.{hook.__qualname__}"
    for hook in (StorageInfo, serialization._get_layout, dcp_metadata._MEM_FORMAT_ENCODING)
)


def storage_dtypes() -> dict[str, torch.dtype]:
    """Storage class names as ``torch.save`` writes them, and the dtype each holds:
    ``FloatStorage`` -> float32, ..., ``UntypedStorage`` -> bytes (uint8); no quantized ones."""
    return {name: dtype for dtype, name in _STORAGE_NAMES.items()} | {"UntypedStorage": torch.uint8}


def save_tensor_without_crc(tensor: torch.Tensor, out: Any) -> None:
    """``torch.save`` without torch's per-record crc32, which would hash every byte twice.

    Our item checksum already covers every byte of the stream, and torch's reader never checks
    the zip crc32. This uses torch's private ``_save`` where its signature is the known one (the
    public ``set_crc32_options`` is process-global, so flipping it would race with other threads
    saving); elsewhere it is plain ``torch.save``. Measured: 0.52 -> 0.12 CPU s per GiB saved.
    """
    if not _PRIVATE_SAVE:
        torch.save(tensor, out)
        return
    writer = torch._C.PyTorchFileWriter(out, False, serialization._get_storage_alignment())
    try:
        serialization._save(  # type: ignore[no-untyped-call]
            tensor, writer, pickle, serialization.DEFAULT_PROTOCOL, False
        )
    except BaseException:
        # An unfinished writer finishes itself in its C++ destructor; with a stream that has
        # just failed, that throws there and aborts the interpreter at the next collection.
        # Finishing it here marks it finished even when this throws, as a catchable error.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


# Staging copies thousands of small tensors per save; one ``_foreach_copy_`` call replaces one
# Python-level ``copy_`` dispatch per tensor (the per-tensor cost that dominated staging at
# 4,096 tensors of 32 KiB). Private in name.
def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """``dst.copy_(src)`` for every pair, in one call where ``_foreach_copy_`` takes them."""
    # A mix it does not take (devices, dtypes): the pairs one by one, which raise any error
    # that is really the caller's. Copying a pair twice is harmless.
    with contextlib.suppress(RuntimeError):
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
        return
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=non_blocking)


def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many owners hold ``tensor``'s TensorImpl itself (C++ holders included).

    The staging pool hands out the same cached view on every save; a holder of that very
    tensor does not show in its storage's use count, only here (or in its Python refcount).
    """
    return int(tensor._use_count())  # type: ignore[attr-defined]


def rank_world() -> tuple[int, int]:
    """This process's rank and the default group's world size: ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ``dcp.save`` is ``_save_state_dict`` after ``_stateful_to_state_dict``, which wraps every
# top-level key in DCP's method logger and checks it against the runtime ``Stateful`` protocol
# (``inspect.getattr_static`` per attribute): 14 us a key, 0.14 s of a save of 10,000 top-level
# tensors. DCP's own ``async_save`` hands ``_save_state_dict`` a state dict it resolved first.
# With a keyword it may not take, or while a handler listens to DCP's DEBUG records,
# ``dcp.save`` itself.
_SAVE_KEYWORDS = frozenset(
    {"checkpoint_id", "storage_writer", "planner", "process_group", "no_dist", "use_collectives"}
)
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def dcp_save(state_dict: dict[str, Any], **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.save(state_dict, **kwargs)``, with the same result: each
    ``Stateful`` top-level value replaced by its ``state_dict()``, then DCP's save."""
    if not kwargs.keys() <= _SAVE_KEYWORDS or _dcp_debug_heard():
        # A handler that takes DCP's DEBUG records gets its per-key ones, as with dcp.save.
        return state_dict_saver.save(state_dict, **kwargs)
    no_dist = kwargs.get("no_dist", False) or not (dist.is_available() and dist.is_initialized())
    # reader=False: a StorageWriter.
    writer: Any = storage_setup(
        kwargs.get("storage_writer"), kwargs.get("checkpoint_id"), reader=False
    )
    return state_dict_saver._save_state_dict(
        state_dict={key: _state_of(value) for key, value in state_dict.items()},
        storage_writer=writer,
        process_group=kwargs.get("process_group"),
        no_dist=no_dist,
        planner=kwargs.get("planner"),
        use_collectives=kwargs.get("use_collectives", True),
    )


def _state_of(value: Any) -> Any:
    """What ``_stateful_to_state_dict`` makes of one value; a plain tensor (no instance
    attribute of the protocol's names) is no ``Stateful`` without the protocol check."""
    attributes = value.__dict__ if type(value) in _PLAIN_TENSOR_TYPES else None
    if attributes is not None and not {"state_dict", "load_state_dict"} & attributes.keys():
        return value
    return value.state_dict() if isinstance(value, Stateful) else value


# ``dcp.async_save`` walks the state the same way on the caller's thread (the training loop's
# stall: 0.15 s of a 0.2 s manager save of 10,000 top-level tensors), and its upload thread
# runs ``dcp.save``, which walks the staged copy again. Same fallbacks as ``dcp_save``, and
# DCP's own for its process executor or a call without a stager (DCP then makes and closes one).
_ASYNC_KEYWORDS = _SAVE_KEYWORDS | {"async_stager", "async_checkpointer_type"}


def dcp_async_save(state_dict: dict[str, Any], **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.async_save(state_dict, **kwargs)``, with the same result:
    the ``Stateful`` top-level values resolved, the state staged by ``async_stager`` on this
    thread, then saved (:func:`dcp_save`) on a thread of its own."""
    stager = kwargs.get("async_stager")
    kind = getattr(kwargs.get("async_checkpointer_type"), "value", "thread")
    if (
        stager is None
        or kind != "thread"
        or not kwargs.keys() <= _ASYNC_KEYWORDS
        or _dcp_debug_heard()
    ):
        return state_dict_saver.async_save(state_dict, **kwargs)
    save_kwargs = {key: kwargs[key] for key in _SAVE_KEYWORDS if key in kwargs}
    if dist.is_available() and dist.is_initialized():  # DCP's check: plans go over a CPU backend
        group, cpu = kwargs.get("process_group") or c10d._get_default_group(), torch.device("cpu")
        if cpu not in getattr(group, "_device_types", (cpu,)):
            raise AssertionError(
                "A CPU backend must be enabled for async save; try initializing process group"
                " with 'cpu:gloo,cuda:nccl'"
            )
    torch._C._log_api_usage_once("torch.distributed.checkpoint.async_save")
    staged = stager.stage({key: _state_of(value) for key, value in state_dict.items()})
    # One thread per save, as DCP's thread executor: a save never queues behind another here.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="AsyncCheckpointExecutor")
    upload: Future[Any] = executor.submit(_save_staged, staged, save_kwargs)
    upload.add_done_callback(lambda _: executor.shutdown(wait=False))
    if not isinstance(staged, Future):
        if getattr(stager, "should_synchronize_after_execute", False):
            stager.synchronize_staging()
        return upload
    staging: Future[None] = Future()
    staged.add_done_callback(lambda done: _forward_staging(done, staging))
    return state_dict_saver.AsyncSaveResponse(staging_completion=staging, upload_completion=upload)


def _save_staged(staged: Any, save_kwargs: dict[str, Any]) -> Any:
    return dcp_save(staged.result() if isinstance(staged, Future) else staged, **save_kwargs)


def _forward_staging(done: Future[Any], staging: Future[None]) -> None:
    if (error := done.exception()) is None:
        staging.set_result(None)
    else:
        staging.set_exception(error)
