"""Whole tensors out of a committed checkpoint, verified, a bounded batch at a time.

Assembling a global tensor from the chunks several ranks saved is what a DCP load onto one
process does, so this drives :class:`~dcp_safe.adapters.reader.SafeStorageReader` in DCP's own call
order with a state dict holding only the next few freshly allocated tensors; the reader checks
every item before the planner sees it. Not ``dcp.load`` per tensor: that would re-open and
re-check the checkpoint every time. The memory bound: docs/export.md, "Memory".
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from dcp_safe import layout
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.exporting.selection import TensorEntry
from dcp_safe.manifest.streams import short_read
from dcp_safe.topology import RootLike

__all__ = ["BATCH_BYTES", "Consolidator", "NotPlainData", "batches"]

#: Tensors read together, in bytes: enough to amortise a read call over many small tensors.
BATCH_BYTES = 64 << 20


class NotPlainData:
    """Stands for a non-tensor entry that does not load as plain data (a ``BytesIO``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _ExportPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state dict of exactly the keys being read; an object
    that does not load with torch's weights-only unpickler becomes a :class:`NotPlainData`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:
            reason = f"does not load as plain data ({type(exc).__name__})"
            self.state_dict[key] = NotPlainData(reason)


def batches(entries: Sequence[TensorEntry], batch_bytes: int) -> Iterator[list[TensorEntry]]:
    """``entries`` in order, grouped into runs of at most ``batch_bytes`` (stored size); a
    tensor larger than that is a run of its own."""
    batch: list[TensorEntry] = []
    held = 0
    for entry in entries:
        if batch and held + entry.nbytes > batch_bytes:
            yield batch
            batch, held = [], 0
        batch.append(entry)
        held += entry.nbytes
    if batch:
        yield batch


class Consolidator:
    """Reads whole global tensors and plain objects from one committed checkpoint.

    Args:
        name: the checkpoint's name, or ``"latest"``.
        batch_bytes: tensor bytes read together; a larger tensor is read alone.

    Raises:
        CheckpointNotFoundError: no such committed checkpoint.
        CheckpointCorruptError: its marker, manifest or ``.metadata`` do not check out.
    """

    def __init__(
        self,
        root: RootLike,
        name: str,
        *,
        signing_key: bytes | str | None = None,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self._reader = SafeStorageReader(root, signing_key=signing_key)
        self._reader.reset(name)
        self.metadata: Metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)
        self.name: str = self._reader.checkpoint_id or name
        self.metadata_path = self._reader.backend.full_path(f"{self.name}/{layout.DCP_METADATA}")
        self._batch_bytes = batch_bytes
        self._sizes: dict[str, int] = {}  # each data file's real size, asked once

    def each_tensor(
        self,
        entries: Sequence[TensorEntry],
        consume: Callable[[TensorEntry, torch.Tensor], object],
    ) -> None:
        """Call ``consume(entry, tensor)`` for every entry, in order, with its whole tensor.

        The tensor is dropped when ``consume`` returns (keep no reference to it: the bound
        on memory counts on that).

        Raises:
            CheckpointCorruptError: an item's bytes do not match its checksum, or a file is
                missing or short.
        """
        for batch in batches(entries, self._batch_bytes):
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
                rel = f"{self.name}/{info.relative_path}"
                if rel not in self._sizes:
                    self._sizes[rel] = self._reader.backend.size(rel)
                if info.offset + info.length > self._sizes[rel]:
                    raise short_read(
                        self._reader.backend.full_path(rel),
                        f"{entry.key}@{list(chunk.offsets)}",
                        info.length,
                        max(0, self._sizes[rel] - info.offset),
                    )

    def objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """The non-tensor entries ``keys``, each as loaded or as a :class:`NotPlainData`."""
        state: dict[str, Any] = dict.fromkeys(keys)
        if state:
            self._read(state)
        return state

    def _read(self, state: dict[str, Any]) -> None:
        planner = _ExportPlanner()
        planner.set_up_planner(state, self.metadata, is_coordinator=True)
        local = self._reader.prepare_local_plan(planner.create_local_plan())
        (central,) = self._reader.prepare_global_plan(planner.create_global_plan([local]))
        self._reader.read_data(planner.finish_plan(central), planner).wait()
