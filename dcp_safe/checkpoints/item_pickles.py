"""What the pickle of a tensor or object item may build: plain data, and tensors made of the
item's own records. The one unpickler the load path and deep verification share.

Not torch's weights-only unpickler: it admits legacy constructors (``torch.FloatTensor(n)``:
uninitialized memory, or a gigabyte from a few bytes), ``bytearray(n)`` and tensors over any
storage the pickle names. :func:`scan` reads the opcodes first, refusing those that set
attributes or build arbitrary objects; :class:`ItemUnpickler` then maps each admitted global to
dcp_safe's own implementation (details: docs/integrity.md, "Loading never runs code from the
checkpoint"). Tensors share the item's memory when it is writable, so a decoded item costs its
bytes once, as ``torch.load`` does.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
import pickletools
from collections.abc import Callable
from typing import Any, TypeGuard

import torch

from dcp_safe.checkpoints.torch_zip import MemorySource, TorchArchive, open_archive
from dcp_safe.errors import CheckpointCorruptError, DcpSafeError, UnsafeCheckpointError
from dcp_safe.manifest.dcp_metadata import MAX_DIMS
from dcp_safe.manifest.limits import MAX_INT
from dcp_safe.torch_compat import STORAGE_MODULES, TENSOR_REBUILDERS, storage_dtypes

#: Opcodes in an object item's pickle at most (a list of a million floats is about this many;
#: each opcode makes at most one object, so this bounds what the pickle allocates).
OBJECT_MAX_OPS = 1 << 20
#: Opcodes in a tensor item's pickle at most (torch writes about 30).
TENSOR_MAX_OPS = 1 << 10
# Opcodes that set attributes on (or construct) arbitrary objects, reach the extension
# registry, or take persistent ids or buffers other than torch's.
_REFUSED_OPS = frozenset(
    {"BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID"}
    | {"NEXT_BUFFER", "READONLY_BUFFER"}
)
_STORAGE_DTYPES = storage_dtypes()
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_UNSAFE_FOR_MEMORY = "decoding it would take more memory than the item declares"


def scan(data: bytes | memoryview, path: str, item: str, *, max_ops: int) -> frozenset[str]:
    """Read ``data``'s opcodes without building anything; the refused ones it holds.
    UnsafeCheckpointError: more than ``max_ops`` opcodes; CheckpointCorruptError: no pickle."""
    found: set[str] = set()
    try:
        for count, (opcode, _, _) in enumerate(pickletools.genops(io.BytesIO(data))):
            if count >= max_ops:
                break
            if opcode.name in _REFUSED_OPS:
                found.add(opcode.name)
        else:
            return frozenset(found)
    except Exception as exc:  # genops: ValueError on a bad opcode or a short argument
        raise CheckpointCorruptError(
            path, f"not a pickle ({type(exc).__name__}: {str(exc)[:200]})", item=item
        ) from None
    raise UnsafeCheckpointError(
        path, f"the pickle has more than {max_ops} opcodes", item=item, because=_UNSAFE_FOR_MEMORY
    )


class StandIn:
    """What a pickle made of a global: its arguments and its state; nothing of the class runs."""

    __slots__ = ("args", "state")
    args: tuple[Any, ...]
    state: Any
    qualname = ""

    def __new__(cls, *args: object) -> StandIn:
        made = object.__new__(cls)
        made.args, made.state = args, None
        return made

    def __setstate__(self, state: object) -> None:
        self.state = state


class Shadows(pickle.Unpickler):
    """Unpickles into stand-ins, a fresh class per global and load (``BUILD`` reaches nothing
    shared), noting every global named; a persistent id (an item's storage) is None. For
    reading what a pickle holds without trusting it: a stock checkpoint's ``.metadata``, the
    classes an object item needs, a pickled ``BytesIO``."""

    def __init__(self, data: bytes | memoryview) -> None:
        super().__init__(io.BytesIO(data))
        self.stands: dict[tuple[str, str], type[StandIn]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) not in self.stands:
            fields = {"__slots__": (), "qualname": f"{module}.{name}"}
            self.stands[module, name] = type(name, (StandIn,), fields)
        return self.stands[module, name]

    def persistent_load(self, pid: Any) -> None:
        return None


def is_stand_in(value: object, qualname: str) -> TypeGuard[StandIn]:
    """Whether ``value`` is what :class:`Shadows` made of the global ``qualname``."""
    return isinstance(value, StandIn) and type(value).qualname == qualname


class _StorageKind:
    """What a storage class name means in a persistent id: the dtype its bytes hold. Not
    callable, so a pickle cannot make a storage of its own with it."""

    __slots__ = ("dtype", "untyped")

    def __init__(self, dtype: torch.dtype, untyped: bool) -> None:
        self.dtype, self.untyped = dtype, untyped

    def __call__(self, *args: object) -> None:
        raise Refused(
            "a storage made by calling its class, not read from the item's records",
            because="the restored state would receive memory no checkpoint wrote",
        )


class _Storage:
    """One record of the archive, as a storage this load made (and nothing else made)."""

    __slots__ = ("bytes", "kind", "owner")

    def __init__(self, data: torch.Tensor, kind: _StorageKind, owner: object) -> None:
        self.bytes, self.kind, self.owner = data, kind, owner


class Refused(pickle.UnpicklingError):
    """An admitted name was asked to make something from more than the item's bytes
    (``bytearray(n)``, a storage constructor); the caller raises ``UnsafeCheckpointError``."""

    def __init__(self, reason: str, because: str) -> None:
        super().__init__(reason)
        self.because = because


def latin1(text: object, encoding: object) -> bytes:
    """``_codecs.encode`` as protocol 2 pickles bytes: ``encode(str, "latin1")``, nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("only latin-1 text may be encoded to bytes here")
    return text.encode("latin1")


def _bytearray(*args: object) -> bytearray:
    """``bytearray`` from bytes or latin-1 text, as pickles write one; never from a length."""
    if len(args) == 1 and isinstance(args[0], bytes):
        return bytearray(args[0])
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin-1", "latin1"):
        return bytearray(args[0].encode("latin-1"))
    if not args:
        return bytearray()
    raise Refused("a bytearray made from a length, not from bytes", because=_UNSAFE_FOR_MEMORY)


def _device(name: object, index: object = None) -> torch.device:
    if not isinstance(name, str) or len(name) > 64:
        raise pickle.UnpicklingError("a device is rebuilt only from its name")
    if index is None:
        return torch.device(name)
    if type(index) is not int or not 0 <= index < 1 << 16:
        raise pickle.UnpicklingError("a device index is a small integer")
    return torch.device(name, index)


_PLAIN: dict[tuple[str, str], Callable[..., Any]] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("_codecs", "encode"): latin1,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): _device,
}


class ItemUnpickler(pickle.Unpickler):
    """Loads an item's ``data.pkl`` (already :func:`scan`-ned) from its own archive: an object
    item's (``plain_data``: plain containers, numbers, strings, tensors), else a tensor item's
    (the tensor rebuilders only). ``materialize=False`` (deep verification) checks each view
    against its record and returns meta tensors, reading no tensor bytes."""

    def __init__(
        self,
        archive: TorchArchive,
        pickled: bytes | memoryview,
        path: str,
        item: str,
        *,
        plain_data: bool,
        materialize: bool = True,
    ) -> None:
        super().__init__(io.BytesIO(pickled))
        self.archive, self.path, self.item = archive, path, item
        self.plain_data, self.materialize = plain_data, materialize
        self.storages: dict[str, _Storage] = {}
        self.built: list[torch.Tensor] = []

    def load_checked(self, what: str) -> Any:
        """:meth:`load`, its errors typed: a refusal unsafe, anything else malformed bytes make
        the unpickler or torch raise corrupt (``what`` the item should have been)."""
        try:
            return self.load()
        except DcpSafeError:
            raise
        except Refused as exc:
            raise UnsafeCheckpointError(
                self.path, str(exc), item=self.item, because=exc.because
            ) from None
        except Exception as exc:
            raise CheckpointCorruptError(
                self.path, f"not {what} ({type(exc).__name__}: {str(exc)[:200]})", item=self.item
            ) from None

    def refuse(self, what: str) -> UnsafeCheckpointError:
        kind = "object is not plain data" if self.plain_data else "item is not a plain tensor"
        why = f"it refers to {what[:120]}; only plain data and tensors made of the item's own bytes"
        return UnsafeCheckpointError(self.path, f"the {kind} ({why} are loaded)", item=self.item)

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol 2 names builtins as Python 2 did
            module = "builtins"
        rebuilder = TENSOR_REBUILDERS.get((module, name))
        if rebuilder == "tensor_v2":
            return self.tensor
        if rebuilder == "tensor_v3":
            return self.rebuild_v3
        if rebuilder == "parameter" and self.plain_data:
            return _parameter
        if module in STORAGE_MODULES and name in _STORAGE_DTYPES:
            return _StorageKind(_STORAGE_DTYPES[name], untyped=name == "UntypedStorage")
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (self.plain_data or name == "OrderedDict") and (module, name) in _PLAIN:
            return _PLAIN[module, name]  # a tensor item's pickle may hold an OrderedDict too
        raise self.refuse(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise self.refuse("a persistent id that is not one of torch's storages")
        _, kind, key, location, numel = pid
        if not isinstance(kind, _StorageKind):
            raise self.refuse("a storage of an unknown type")
        if not (isinstance(key, str) and len(key) <= 64 and isinstance(location, str)):
            raise pickle.UnpicklingError("a storage's key and location are short strings")
        known = self.storages.get(key)
        if known is not None:
            if known.kind.dtype != kind.dtype:
                raise pickle.UnpicklingError(f"storage {key!r} is named with two dtypes")
            return known
        size = self.archive.size(f"data/{key}")
        if size is None:
            raise self.refuse(f"storage {key!r}, which is not a record of the item")
        itemsize = 1 if kind.untyped else kind.dtype.itemsize
        if type(numel) is not int or not 0 <= numel <= size or numel * itemsize != size:
            raise pickle.UnpicklingError(f"storage {key!r}: its size is not its record's")
        self.storages[key] = _Storage(self.record_bytes(f"data/{key}", size), kind, self)
        return self.storages[key]

    def record_bytes(self, name: str, size: int) -> torch.Tensor:
        """The record's bytes as a uint8 tensor (a view of the item's memory where it can)."""
        if not self.materialize or size == 0:
            return torch.empty(size, dtype=torch.uint8, device="meta" if size else "cpu")
        data = self.archive.read(name)
        assert data is not None
        source = self.archive.source
        if isinstance(source, MemorySource) and source.writable and isinstance(data, memoryview):
            tensor = torch.frombuffer(data, dtype=torch.uint8)
        else:
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()

    def rebuild_v3(self, *args: object) -> torch.Tensor:
        """``_rebuild_tensor_v3``: v2's arguments with a dtype before the metadata."""
        if len(args) not in (7, 8) or not isinstance(args[6], torch.dtype):
            raise pickle.UnpicklingError("a tensor's dtype is not a dtype")
        return self.tensor(*args[:6], *args[7:], dtype=args[6])

    def tensor(
        self,
        storage: object,
        offset: object,
        size: object,
        stride: object,
        requires_grad: object,
        hooks: object,
        metadata: object = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``_rebuild_tensor_v2`` (the storage's dtype), or v3's with ``dtype``."""
        if not isinstance(storage, _Storage) or storage.owner is not self:
            raise self.refuse("a tensor over a storage that is not one of the item's records")
        if (dtype is None) == storage.kind.untyped:
            raise pickle.UnpicklingError("a tensor's dtype and its storage's disagree")
        if hooks or metadata or not isinstance(requires_grad, bool):
            raise self.refuse("a tensor with hooks or Python state")
        dtype = storage.kind.dtype if dtype is None else dtype
        shape, strides, start = _dims(size), _dims(stride), _index(offset)
        if len(shape) != len(strides):
            raise pickle.UnpicklingError("a tensor's size and stride disagree")
        itemsize = max(1, dtype.itemsize)
        available = storage.bytes.numel()
        if available % itemsize:
            raise pickle.UnpicklingError("a storage that does not hold whole elements")
        _check_view(start, shape, strides, available // itemsize)
        base = storage.bytes.view(dtype) if available else storage.bytes.to(dtype)
        tensor = base.as_strided(shape, strides, start)
        if requires_grad:
            if not (dtype.is_floating_point or dtype.is_complex):
                raise pickle.UnpicklingError("requires_grad on a tensor of integers")
            tensor.requires_grad_(True)
        self.built.append(tensor)
        return tensor


def refused_globals(data: bytes | bytearray | memoryview, path: str, item: str) -> set[str]:
    """The globals (``module.name``) that the pickle of the object item ``data`` names and
    :class:`ItemUnpickler` refuses: the classes it needs, read by :class:`Shadows` so that none
    runs, its opcodes bounded first (errors as :func:`scan`'s)."""
    archive = open_archive(MemorySource(data), path, item)
    pickled = archive.read("data.pkl") or b""
    scan(pickled, path, item, max_ops=OBJECT_MAX_OPS)
    shadows = Shadows(pickled)
    with contextlib.suppress(Exception):  # only the names are wanted, whatever else fails
        shadows.load()
    unpickler = ItemUnpickler(archive, pickled, path, item, plain_data=True)
    refused: set[str] = set()
    for module, name in shadows.stands:
        try:
            unpickler.find_class(module, name)
        except UnsafeCheckpointError:
            refused.add(f"{module}.{name}")
    return refused


def _parameter(data: object, requires_grad: object, hooks: object) -> torch.nn.Parameter:
    if not isinstance(data, torch.Tensor) or not isinstance(requires_grad, bool) or hooks:
        raise pickle.UnpicklingError("a parameter is a tensor, a flag and no hooks")
    return torch.nn.Parameter(data, requires_grad=requires_grad)


def _index(value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise pickle.UnpicklingError("a tensor's offset is not an index")
    return value


def _dims(value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise pickle.UnpicklingError(f"a tensor's sizes are not a tuple of {MAX_DIMS} at most")
    return tuple(_index(v) for v in value)


def _check_view(
    start: int, shape: tuple[int, ...], strides: tuple[int, ...], elements: int
) -> None:
    """The view must lie inside the storage: every size is checked against the storage's
    elements before any product is formed."""
    if 0 in shape:
        if start > elements:
            raise pickle.UnpicklingError("an empty tensor's offset lies past its storage")
        return
    last = start
    for size, stride in zip(shape, strides, strict=True):
        if size > 1 and (size > elements or stride > elements):
            raise pickle.UnpicklingError("a tensor larger than its storage")
        last += (size - 1) * stride
    if last >= elements:
        raise pickle.UnpicklingError("a tensor larger than its storage")
