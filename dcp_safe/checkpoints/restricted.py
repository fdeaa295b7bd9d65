"""Loading what a checkpoint pickled, without running code from storage.

``.metadata`` is unpickled only for a root the caller trusts (``allow_pickle=True``:
:mod:`dcp_safe.checkpoints.metadata`); loads read the manifest's plain form instead. A
non-tensor item is decoded by dcp_safe's bounded unpickler
(:mod:`dcp_safe.checkpoints.item_pickles`) and DCP's planner is handed a stream re-serialized
from that safe value, so it can only rebuild what was admitted; an ``io.BytesIO`` entry is
rebuilt from its bytes by :class:`_BytesIOUnpickler`, an exact decoder of what
``torch.save(BytesIO)`` writes. Anything else raises
:class:`~dcp_safe.errors.UnsafeCheckpointError`. The threat model: docs/integrity.md, "Loading
never runs code from the checkpoint".

It lives below the DCP adapters so that deep verification (:mod:`dcp_safe.checkpoints.loadable`)
applies the very checks a load applies.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from dcp_safe.checkpoints.item_pickles import OBJECT_MAX_OPS, ItemUnpickler, latin1, scan
from dcp_safe.checkpoints.items import item_archive
from dcp_safe.checkpoints.torch_zip import MAX_RECORDS
from dcp_safe.errors import UnsafeCheckpointError

__all__ = ["decode_object", "sanitized_object_stream"]

#: The deepest nesting of containers an object item may hold (honest states: a handful).
MAX_NESTING = 100
_CONTAINERS = (dict, list, tuple, set, frozenset)

# What torch.save writes for a BytesIO and nothing else may use.
_BYTES_IO_OPS = frozenset(("NEWOBJ", "BUILD"))


def decode_object(
    data: bytes | bytearray | memoryview, path: str, item: str, *, materialize: bool = True
) -> Any:
    """The value an object item holds (after its transforms), decoded without running code.

    ``materialize=False`` (deep verification) checks tensors in it without reading their
    bytes (they come back as meta tensors).

    Raises:
        UnsafeCheckpointError: the item holds more than plain data and its own tensors, or
            is over the opcode or record budget.
        CheckpointCorruptError: it is not something ``torch.save`` wrote.
    """
    archive, pickled = item_archive(data, path=path, item=item, max_records=MAX_RECORDS)
    refused = scan(pickled, path, item, max_ops=OBJECT_MAX_OPS)
    if refused:
        found = _bytes_io(pickled) if refused <= _BYTES_IO_OPS else None
        if found is None:
            raise UnsafeCheckpointError(
                path,
                f"the object is not plain data (its pickle uses {', '.join(sorted(refused))})",
                item=item,
            )
        return found
    unpickler = ItemUnpickler(
        archive, pickled, path, item, plain_data=True, materialize=materialize
    )
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
        inner = _inner(node)
        if done:
            on_path.discard(id(node))
            heights[id(node)] = 1 + max((heights[id(c)] for c in inner), default=0)
            if heights[id(node)] > MAX_NESTING:
                raise UnsafeCheckpointError(
                    path,
                    f"the object nests containers more than {MAX_NESTING} levels deep",
                    item=item,
                    because="copying it for the load would exhaust the stack",
                )
        elif any(id(c) in on_path for c in inner):
            raise UnsafeCheckpointError(
                path, "the object contains itself", item=item, because="it nests without end"
            )
        else:
            on_path.add(id(node))
            stack.append((node, True))
            stack += [(c, False) for c in inner if id(c) not in heights]


def _inner(node: Any) -> list[Any]:
    """The containers directly in ``node`` (a dict's keys and values)."""
    members = [*node.keys(), *node.values()] if isinstance(node, dict) else node
    return [c for c in members if isinstance(c, _CONTAINERS)]


def sanitized_object_stream(
    payload: io.BytesIO | bytes | bytearray | memoryview,
    path: str,
    item: str,
    *,
    allow_pickle: bool = False,
) -> io.BytesIO:
    """A stream the planner may ``torch.load`` as it likes: re-serialized from a safe decode.

    Raises:
        UnsafeCheckpointError: the item holds more than plain data and its own tensors.
        CheckpointCorruptError: it is not something ``torch.save`` wrote.
    """
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


class _BytesIOUnpickler(pickle.Unpickler):
    """Hands out a fresh holder class and a fresh encoder for each load: ``BUILD`` may reach
    what ``find_class`` returns, and must find nothing that outlives this load."""

    def __init__(self, stream: io.BytesIO) -> None:
        super().__init__(stream)
        self.holder = type("_BytesIOState", (_BytesIOState,), {})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_io", "BytesIO"):
            return self.holder
        if (module, name) == ("_codecs", "encode"):
            return lambda text, encoding: latin1(text, encoding)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a pickled BytesIO")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a pickled BytesIO holds no storage")


def _bytes_io(pickled: bytes | memoryview) -> io.BytesIO | None:
    """The ``io.BytesIO`` that ``torch.save(BytesIO)`` pickled as ``pickled`` (an archive's
    checked ``data.pkl``); ``None`` if it is not exactly that."""
    unpickler = _BytesIOUnpickler(io.BytesIO(pickled))
    try:
        found = unpickler.load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError):
        return None
    if type(found) is not unpickler.holder:
        return None
    assert isinstance(found, _BytesIOState)
    stream = io.BytesIO(found.value)
    stream.seek(found.position)
    return stream
