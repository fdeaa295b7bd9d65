"""What an export writes: the entries picked from DCP's metadata, their shapes and output dtypes.

A pure function of the verified metadata, the keys and the dtype, known before any data is
read: that is what lets the writers stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_safe.errors import CheckpointCorruptError, ConfigError
from dcp_safe.manifest.verify import chunk_tiling_problem

__all__ = ["Selection", "TensorEntry", "parse_dtype", "select"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to export: its key, its global shape, its stored and its output dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor as stored (what reading it holds in memory)."""
        return self.numel * self.dtype.itemsize

    @property
    def out_nbytes(self) -> int:
        """Bytes of the whole tensor as written."""
        return self.numel * self.out_dtype.itemsize


@dataclass(frozen=True)
class Selection:
    """The selected entries: tensors and non-tensor objects, each sorted by key."""

    tensors: tuple[TensorEntry, ...]
    objects: tuple[str, ...]


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating dtype to cast to, from a ``torch.dtype`` or its name (``"bfloat16"``).

    Raises:
        ConfigError: not a dtype name, or not a floating dtype.
    """
    if dtype is None:
        return None
    found = dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)  # type: ignore[assignment]
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ConfigError(
            f"dtype must be a floating torch dtype such as torch.bfloat16 or 'float16', "
            f"got {dtype!r}"
        )
    return found


def select(
    metadata: Metadata, keys: Sequence[str] | None, dtype: torch.dtype | None, *, where: str
) -> Selection:
    """The entries of ``metadata`` that ``keys`` select (all when ``None``), with output dtypes.

    Args:
        keys: full keys or prefixes on a dot boundary (``model`` selects ``model.w``).
        dtype: cast floating tensors to this dtype; other tensors keep theirs.
        where: the metadata's path, for errors.

    Raises:
        ConfigError: ``keys`` is empty, holds a non-string, or a key selects nothing.
        CheckpointCorruptError: a tensor's chunks do not add up to its global shape.
    """
    entries = metadata.state_dict_metadata
    chosen = sorted(entries) if keys is None else _matching(sorted(entries), keys)
    tensors: list[TensorEntry] = []
    objects: list[str] = []
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
        problem = chunk_tiling_problem(shape, chunks)
        if problem is not None:
            raise CheckpointCorruptError(
                where,
                f"the tensor's stored chunks do not tile its global shape: {problem}",
                item=key,
            )
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        tensors.append(TensorEntry(key=key, shape=shape, dtype=stored, out_dtype=cast))
    return Selection(tensors=tuple(tensors), objects=tuple(objects))


def _matching(available: list[str], keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        keys = [keys]
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ConfigError(f"keys must be a non-empty list of key names or prefixes, got {keys!r}")
    chosen: set[str] = set()
    missing: list[str] = []
    for key in keys:
        found = [name for name in available if name == key or name.startswith(key + ".")]
        if not found:
            missing.append(key)
        chosen.update(found)
    if missing:
        shown = ", ".join(repr(key) for key in missing[:8])
        more = f" ({len(missing)} in all)" if len(missing) > 8 else ""
        raise ConfigError(
            f"keys not in the checkpoint: {shown}{more}; a key selects the entry of that name"
            " and the entries below it (dotted names, as 'dcp-safe inspect' lists them)"
        )
    return sorted(chosen)
