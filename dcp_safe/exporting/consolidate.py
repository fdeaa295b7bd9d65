"""What an export reads: the entries picked from DCP's metadata, and their whole tensors,
verified, a bounded batch at a time.

The selection is a pure function of the verified metadata, the keys and the dtype, known before
any data is read: that is what lets the writers stream. Assembling a global tensor from the
chunks several ranks saved is what a DCP load onto one process does, so :class:`Consolidator`
drives :class:`~dcp_safe.adapters.reader.SafeStorageReader` in DCP's own call order with a state
dict holding only the next few freshly allocated tensors; the reader checks every item before
the planner sees it. Not ``dcp.load`` per tensor: that would re-open and re-check the
checkpoint every time. The memory bound: docs/export.md, "Memory".
"""

from __future__ import annotations

import collections
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from dcp_safe import layout
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.backends.listed_sizes import ListedSizes
from dcp_safe.errors import CheckpointCorruptError, ConfigError
from dcp_safe.manifest.streams import short_read
from dcp_safe.manifest.verify import chunk_tiling_problem
from dcp_safe.topology import RootLike


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to export: its key, its global shape, its stored and its output dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor as stored (what reading it holds in memory)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def out_nbytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize


@dataclass(frozen=True)
class Selection:
    """The selected entries: tensors and non-tensor objects, each sorted by key."""

    tensors: tuple[TensorEntry, ...]
    objects: tuple[str, ...]


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating dtype to cast to, from a ``torch.dtype`` or its name (``"bfloat16"``);
    ConfigError for anything else."""
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if dtype is not None and not (isinstance(found, torch.dtype) and found.is_floating_point):
        why = "dtype must be a floating torch dtype such as torch.bfloat16 or 'float16'"
        raise ConfigError(f"{why}, got {dtype!r}")
    return found


def select(
    metadata: Metadata, keys: Sequence[str] | None, dtype: torch.dtype | None, *, where: str
) -> Selection:
    """The entries of ``metadata`` that ``keys`` (full keys or prefixes on a dot boundary:
    ``model`` selects ``model.w``; ``None``: all) select; floating tensors cast to ``dtype``.
    ConfigError: ``keys`` is empty, holds a non-string, or a key selects nothing;
    CheckpointCorruptError: a tensor's chunks do not add up to its global shape."""
    entries = metadata.state_dict_metadata
    chosen = sorted(entries) if keys is None else _matching(sorted(entries), keys)
    tensors, objects = list[TensorEntry](), list[str]()
    for key in chosen:
        meta = entries[key]
        if not isinstance(meta, TensorStorageMetadata):
            objects.append(key)
            continue
        shape = tuple(int(size) for size in meta.size)
        stored = meta.properties.dtype
        # A gap would be exported as uninitialised memory (the whole tensor is allocated
        # before it is read): the stored chunks must tile the global shape exactly.
        chunks = [(tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in meta.chunks]
        if (problem := chunk_tiling_problem(shape, chunks)) is not None:
            why = f"the tensor's stored chunks do not tile its global shape: {problem}"
            raise CheckpointCorruptError(where, why, item=key)
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        tensors.append(TensorEntry(key=key, shape=shape, dtype=stored, out_dtype=cast))
    return Selection(tensors=tuple(tensors), objects=tuple(objects))


def _matching(available: list[str], keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        keys = [keys]
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ConfigError(f"keys must be a non-empty list of key names or prefixes, got {keys!r}")
    found = {key: [n for n in available if n == key or n.startswith(key + ".")] for key in keys}
    if missing := [key for key, names in found.items() if not names]:
        shown = ", ".join(repr(key) for key in missing[:8])
        more = f" ({len(missing)} in all)" if len(missing) > 8 else ""
        raise ConfigError(
            f"keys not in the checkpoint: {shown}{more}; a key selects the entry of that name"
            " and the entries below it (dotted names, as 'dcp-safe inspect' lists them)"
        )
    return sorted({name for names in found.values() for name in names})


#: Tensors read together, in bytes: enough to amortise a read call over many small tensors.
BATCH_BYTES = 64 << 20


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


@dataclass(frozen=True)
class NotPlainData:
    """Stands for a non-tensor entry that is not plain data (a ``BytesIO``), with the reason."""

    reason: str


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data that ``torch.load(weights_only=True)`` rebuilds:
    ``None``, numbers, strings, bytes, and lists, tuples and dicts of them."""
    if type(value) in (dict, collections.OrderedDict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN) or (type(value) in (list, tuple) and all(map(is_plain, value)))


class _ExportPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state dict of exactly the keys being read; an object
    that is not plain data (:func:`is_plain`, after torch's weights-only unpickler) becomes a
    :class:`NotPlainData`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            found = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:
            found = NotPlainData(f"does not load as plain data ({type(exc).__name__})")
        if not isinstance(found, NotPlainData) and not is_plain(found):
            found = NotPlainData(f"not plain data ({type(found).__name__})")
        self.state_dict[read_item.dest_index.fqn] = found


def runs(
    entries: Sequence[TensorEntry], limit: int, *, written: bool = False
) -> list[list[TensorEntry]]:
    """``entries`` in order, in runs of at most ``limit`` bytes (stored; ``written``: as
    written), a tensor larger than that a run of its own: the reads of an export, and the
    shards of a safetensors one."""
    runs: list[list[TensorEntry]] = [[]]
    held = 0
    for entry in entries:
        size = entry.out_nbytes if written else entry.nbytes
        if runs[-1] and held + size > limit:
            runs.append([])
            held = 0
        runs[-1].append(entry)
        held += size
    return runs if runs[-1] else []


class Consolidator:
    """Reads whole global tensors and plain objects from checkpoint ``name`` (or ``"latest"``),
    once it is found (else CheckpointNotFoundError) and its marker, manifest and ``.metadata``
    check out (else CheckpointCorruptError)."""

    def __init__(
        self, root: RootLike, name: str, *, signing_key: bytes | str | None = None
    ) -> None:
        self._reader = SafeStorageReader(root, signing_key=signing_key)
        self._reader.reset(name)
        self.metadata: Metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)
        self.name: str = self._reader.checkpoint_id or name
        self.metadata_path = self._reader.backend.full_path(f"{self.name}/{layout.DCP_METADATA}")
        # Each data file's real size: listed, or else asked, once.
        self._sizes = ListedSizes(self._reader.backend, self.name)

    def each_tensor(
        self, entries: Sequence[TensorEntry], consume: Callable[[TensorEntry, torch.Tensor], object]
    ) -> None:
        """Call ``consume(entry, tensor)`` for every entry, in order, with its whole tensor,
        dropped when ``consume`` returns (keep no reference to it: the bound on memory counts
        on that). CheckpointCorruptError: an item's bytes do not match its checksum, or a file
        is missing or short."""
        for batch in runs(entries, BATCH_BYTES):
            self._require_stored(batch)
            state: dict[str, Any] = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in batch}
            self._read(state)
            for entry in batch:
                consume(entry, state.pop(entry.key))

    def _require_stored(self, entries: Sequence[TensorEntry]) -> None:
        """Refuse, before the tensors are allocated, an item of ``entries`` that reaches past
        the end of its file as the file really is. A tensor is no larger than its chunks (they
        tile it) nor a chunk than its item's bytes allow (the metadata's decoder), so every
        allocation is then backed by a real file (docs/integrity.md, "Hostile storage")."""
        storage = self.metadata.storage_data
        for entry in entries:
            meta = self.metadata.state_dict_metadata[entry.key]
            assert isinstance(meta, TensorStorageMetadata)  # select() took only tensors
            for chunk in meta.chunks:
                info = storage[MetadataIndex(entry.key, chunk.offsets)]
                stored = self._sizes.size(info.relative_path)
                if info.offset + info.length > stored:
                    path = self._reader.backend.full_path(self._sizes.path(info.relative_path))
                    label = f"{entry.key}@{list(chunk.offsets)}"
                    left = max(0, stored - info.offset)
                    raise short_read(path, label, info.length, left)

    def objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """The non-tensor entries ``keys``, each as loaded or as a :class:`NotPlainData`."""
        state: dict[str, Any] = dict.fromkeys(keys)
        if state:
            self._read(state)
        return state

    def _read(self, state: dict[str, Any]) -> None:
        planner = _ExportPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        planner.set_up_planner(state, self.metadata, is_coordinator=True)
        local = self._reader.prepare_local_plan(planner.create_local_plan())
        (central,) = self._reader.prepare_global_plan(planner.create_global_plan([local]))
        self._reader.read_data(planner.finish_plan(central), planner).wait()
