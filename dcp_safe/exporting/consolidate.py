"""Whole tensors out of a committed checkpoint, verified, a bounded batch at a time.

A tensor saved by several ranks (DTensor, FSDP2) is stored as chunks in several files; DCP's
``.metadata`` says where each chunk lies in the global shape. Assembling the global tensor is
exactly what a DCP load onto a single process does, so this module asks for that and nothing
else: it drives :class:`~dcp_safe.dcp.reader.SafeStorageReader` in DCP's own call order
(``reset``, ``read_metadata``, ``set_up_storage_reader``, the planners' local, global and
final plans, ``read_data``) with a state dict that holds only the next few global tensors,
freshly allocated. The reader checks every item against its checksum before the planner sees
it (:mod:`dcp_safe.dcp.tensor_reads`), so verification is the reader's, not a second one.

Why not ``dcp.load`` once per tensor: it would re-open and re-check the checkpoint (marker,
manifest, ``.metadata``) every time; the reader is opened once here and reused.

Memory: the tensors of one batch are held while their consumer writes them, then dropped
before the next batch is allocated. A batch is the next tensors in key order up to
``batch_bytes`` together, or one tensor alone when it is larger than that, so at most
``max(largest tensor, batch_bytes)`` of tensor data is held at once, plus the reader's
temporaries (a chunk that does not land contiguously in its destination, a compressed item).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from dcp_safe import layout
from dcp_safe.dcp.reader import SafeStorageReader
from dcp_safe.exporting.selection import TensorEntry

__all__ = ["BATCH_BYTES", "Consolidator", "NotPlainData", "batches"]

#: Tensors read together, in bytes: enough to amortise a read call over many small tensors.
BATCH_BYTES = 64 << 20


class NotPlainData:
    """Stands for a non-tensor entry that does not load as plain data (a ``BytesIO``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _ExportPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state dict of exactly the keys being read.

    Objects are loaded with torch's weights-only unpickler from the stream the reader has
    already sanitized (:mod:`dcp_safe.checkpoints.restricted`); one that still does not load
    as plain data is replaced by a :class:`NotPlainData` and skipped by the caller.
    """

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
        root: the checkpoint root (a directory or an fsspec URL).
        name: the checkpoint's name, or ``"latest"``.
        storage_options: fsspec options for a URL root.
        signing_key: accept only a checkpoint signed with this key (as the reader takes it).
        batch_bytes: tensor bytes read together (see the module docstring).

    Raises:
        CheckpointNotFoundError: no such committed checkpoint.
        CheckpointCorruptError: its marker, manifest or ``.metadata`` do not check out.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        name: str,
        *,
        storage_options: dict[str, Any] | None = None,
        signing_key: bytes | str | None = None,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self._reader = SafeStorageReader(
            root, storage_options=storage_options, signing_key=signing_key
        )
        self._reader.reset(name)
        self.metadata: Metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)
        self.name: str = self._reader.checkpoint_id or name
        self.metadata_path = self._reader.backend.full_path(f"{self.name}/{layout.DCP_METADATA}")
        self._batch_bytes = batch_bytes

    def each_tensor(
        self,
        entries: Sequence[TensorEntry],
        consume: Callable[[TensorEntry, torch.Tensor], None],
    ) -> None:
        """Call ``consume(entry, tensor)`` for every entry, in order, with its whole tensor.

        The tensor is dropped when ``consume`` returns (keep no reference to it: the bound
        on memory counts on that).

        Raises:
            CheckpointCorruptError: an item's bytes do not match its checksum, or a file is
                missing or short.
        """
        for batch in batches(entries, self._batch_bytes):
            state: dict[str, Any] = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in batch}
            self._read(state)
            for entry in batch:
                consume(entry, state.pop(entry.key))

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
