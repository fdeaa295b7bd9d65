"""The in-memory tier: the last committed step's staged copy, kept for :meth:`rollback`.

How the copy is kept (by the stager, once its upload succeeded), checked before a byte is copied
(items written from a template against the manifest's checksums, the others against a digest of
their pickle taken at the verified commit) and dropped (after a synchronous save): docs/resume.md,
"Rolling back in memory".
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from dcp_safe.adapters.planners import SafeSavePlanner
from dcp_safe.adapters.tensor_records import (
    layout_for,
    minimal_cpu_tensor,
    template_parts,
    tensor_bytes,
    write_item,
)
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.coordination.agreement import Agreement, Vote
from dcp_safe.errors import (
    BudgetExceededError,
    CheckpointCorruptError,
    ConfigError,
    DcpSafeError,
    MissingKeysError,
    RollbackUnavailableError,
    _per_rank,
)
from dcp_safe.manager.handles import SaveHandle
from dcp_safe.manifest.checksum import ChecksumAlgorithm, format_checksum, new_hasher
from dcp_safe.manifest.schema import ItemKey, Manifest, item_key
from dcp_safe.manifest.streams import HashingSink
from dcp_safe.staging import BudgetedStager
from dcp_safe.staging._tree import collect_tensors, is_stateful, state_dicts_of
from dcp_safe.torch_compat import create_write_items
from dcp_safe.units import format_bytes


@dataclass(eq=False)
class _Kept:  # the kept copy of one committed step, with what checks it
    handle: SaveHandle
    manifest: Manifest
    # Items not written from a template: their pickle's digest when the commit was verified.
    digests: dict[ItemKey, str]


@dataclass(eq=False)
class InMemoryTier:
    """Keeps the last committed step in host memory (the ``stager`` holds the kept generation)
    and rolls the live state back to it. ``backend``: the commit root, whose committed manifest
    is read when a commit is verified; ``per_rank``: the manager's per-rank prefixes."""

    stager: BudgetedStager
    backend: Backend
    per_rank: tuple[str, ...] = ()
    _kept: _Kept | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def check_room(self, state_dict: dict[str, Any]) -> None:
        """``BudgetExceededError`` unless the kept copy and the next staged copy of
        ``state_dict`` both fit the stager's envelope."""
        need = sum(t.nbytes for t in collect_tensors(state_dicts_of(state_dict)))  # as staged
        envelope = self.stager.budget.envelope_bytes
        if 2 * need > envelope:
            raise BudgetExceededError(
                f"keep_in_memory=True holds the last committed copy while the next save stages"
                f" its own: 2 x {format_bytes(need)} does not fit the staging envelope of"
                f" {format_bytes(envelope)}. Raise the budget (MemoryBudget) or pass"
                " keep_in_memory=False"
            )

    def committed(self, handle: SaveHandle) -> None:
        """``handle``'s commit was verified: its kept copy, if the stager holds it, becomes the
        rollback source (on the manager thread; reads the committed manifest)."""
        kept = self.stager.kept()
        if kept is None or kept[0] is not handle:
            self.forget()  # a synchronous save, or one whose copy was not kept
            return
        try:
            manifest = open_committed(self.backend, handle.name).manifest
            entries = [e for e in self._entries(kept[1]) if not e.reproducible]
            record = _Kept(handle, manifest, {e.key: _digest(e.value) for e in entries})
        except BaseException:
            self.forget()  # an older copy must not pass for the last committed step
            raise
        with self._lock:
            self._kept = record

    def forget(self) -> None:  # a newer step committed without a kept copy
        with self._lock:
            self._kept = None
        self.stager.drop_kept()

    def rollback(self, state_dict: dict[str, Any], agreement: Agreement) -> int:
        """:meth:`prepare` on every rank, then, only if every rank can, copy; return the step.
        ``RollbackUnavailableError`` (nothing changed) also where another rank cannot, or the
        ranks' kept steps differ (a rank has not verified the last commit yet)."""
        try:
            step, copies = self.prepare(state_dict)
            failed: DcpSafeError | None = None
        except DcpSafeError as exc:
            step, copies, failed = -1, [], exc
        votes = agreement.gather(Vote("rollback", step, detail=failed and repr(failed)))
        if failed is not None:
            raise failed
        if any((v.call, v.step, v.detail) != ("rollback", step, None) for v in votes):
            seen = _per_rank({r: v.detail or f"step {v.step}" for r, v in enumerate(votes)}, "; ")
            raise RollbackUnavailableError(
                f"the ranks cannot all roll back to one step ({seen}); nothing changed. Call"
                " wait() on every rank so each has verified the last commit, then rollback()"
            )
        with torch.no_grad():
            for copy_into, value in copies:
                copy_into(value)
        return step

    def prepare(self, state_dict: dict[str, Any]) -> tuple[int, list[_Copy]]:
        """Check the kept copy against ``state_dict``; its step and the copies to make. Nothing
        changes until they are made, so every rank can check before any copies (the errors:
        :meth:`~dcp_safe.CheckpointManager.rollback`'s, and ConfigError for another layout)."""
        with self._lock:
            record = self._kept
        kept = self.stager.kept()
        if record is None or kept is None or kept[0] is not record.handle:
            raise RollbackUnavailableError(
                "no in-memory copy of the last committed step: keep_in_memory=True keeps the"
                " copy of each asynchronous save once its commit is verified, and a synchronous"
                " save drops it. Restore from storage with restore()"
            )
        staged = kept[1]
        algorithm = ChecksumAlgorithm(record.manifest.checksum_algorithm)
        compressed = record.manifest.compression == "zstd"
        where = f"memory:{record.handle.name}"
        for entry in self._entries(staged):
            stored = record.manifest.item(entry.key)
            if stored is None:
                raise CheckpointCorruptError(where, "the manifest has no such item", item=entry.fqn)
            if entry.key in record.digests:
                expected, actual = record.digests[entry.key], _digest(entry.value)
            else:
                expected, actual = stored.checksum, entry.checksum(algorithm, compressed)
            if actual != expected:
                raise CheckpointCorruptError(
                    where,
                    "the kept copy changed since it was committed",
                    item=entry.fqn,
                    expected=expected,
                    actual=actual,
                )
        pairing = _Pairing()
        _pair(state_dict, staged, "", pairing)
        if pairing.missing:
            raise MissingKeysError(pairing.missing)
        if pairing.mismatched:
            raise ConfigError(
                "the live state is not laid out as the kept copy: "
                + "; ".join(pairing.mismatched[:10])
                + ". rollback() restores into the state that was saved; use restore() otherwise"
            )
        return record.handle.step, pairing.copies

    def _entries(self, staged: dict[str, Any]) -> Iterator[_Entry]:
        """The items of ``staged`` as this rank's writer stored them (per-rank keys renamed)."""
        planner = SafeSavePlanner(
            per_rank=self.per_rank, check_divergence=False, record_audit=False
        )
        planner.set_up_planner(staged, None, False)
        for fqn, value in planner.state_dict.items():
            if type(value) is torch.Tensor:  # its own single item, at offset 0 (most of them)
                yield _Entry(item_key(fqn, (0,) * value.dim()), fqn, value, value)
                continue
            for item in create_write_items(fqn, value):  # as DCP's planner makes them
                data = planner.resolve_data(item)
                offset = None if item.index.offset is None else tuple(item.index.offset)
                key = item_key(item.index.fqn, offset)
                yield _Entry(key, fqn, data, planner.lookup_object(item.index), item)


@dataclass(frozen=True)
class _Entry:  # one stored item of the kept copy
    key: ItemKey
    fqn: str
    data: Any  # what the writer serialized: a tensor, or torch.save's bytes of an object
    value: Any  # the kept value it came from
    item: WriteItem | None = None  # None: a plain tensor, its own item

    @property
    def reproducible(self) -> bool:  # writing it again gives the stored bytes
        if self.item is not None and self.item.type == WriteItemType.BYTE_IO:
            return False
        tensor = minimal_cpu_tensor(self.data)
        return layout_for(tensor.dtype, tuple(tensor.shape)) is not None

    def checksum(self, algorithm: ChecksumAlgorithm, compressed: bool) -> str:
        """The checksum of its stored bytes, written again into a sink that only hashes."""
        parts = None if compressed else template_parts(self.data)
        if parts is not None:  # the common case, without a sink
            hasher = new_hasher(algorithm, size_hint=parts[1].nbytes)
            for part in parts:
                hasher.update(part)
            return format_checksum(algorithm, hasher)
        item = self.item or create_write_items(self.fqn, self.value)[0]
        with open(os.devnull, "wb") as discard:  # the sink hashes; nothing need be stored
            sink = HashingSink(discard, algorithm)
            write_item(sink, item, self.data, compressed=compressed)
            return sink.take_checksum()


def _digest(value: Any) -> str:
    """A digest of a kept value's content (``torch.save``'s bytes would differ call to call)."""
    if isinstance(value, torch.Tensor):
        tensor = minimal_cpu_tensor(value)
        meta = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
        return hashlib.sha256(meta + bytes(tensor_bytes(tensor))).hexdigest()
    return hashlib.sha256(pickle.dumps(value, protocol=5)).hexdigest()


_Copy = tuple[Callable[[Any], object], Any]  # what copies a kept value, and the value


@dataclass
class _Pairing:  # what a rollback copies where, or why it cannot
    copies: list[_Copy] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Mapping | list | tuple):
        return any(map(_holds_tensors, value.values() if isinstance(value, Mapping) else value))
    return isinstance(value, torch.Tensor)


def _pair(target: Any, source: Any, prefix: str, out: _Pairing) -> None:
    """Match the live ``target`` with the kept ``source``, collecting the copies to make.

    Tensors are copied into in place; a container is walked; any other value (and a sequence
    holding no tensor) is replaced whole by a copy of the kept one."""
    if isinstance(target, torch.Tensor):
        if not isinstance(source, torch.Tensor) or source.shape != target.shape:
            kept = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source)
            out.mismatched.append(f"{prefix}: shape {tuple(target.shape)}, kept {kept}")
            return
        live = target.to_local() if isinstance(target, DTensor) else target
        held = source.to_local() if isinstance(source, DTensor) else source
        out.copies.append((live.copy_, held))
    elif is_stateful(target):
        inner = target.state_dict()  # as DCP loads a Stateful: into its state dict, then back
        _pair(inner, source, prefix, out)
        out.copies.append((lambda _: target.load_state_dict(inner), None))
    elif isinstance(target, MutableMapping):
        if not isinstance(source, Mapping):
            out.mismatched.append(f"{prefix or '<root>'}: a mapping, kept as {type(source)}")
            return
        for key, value in target.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in source:
                out.missing.append(name)
            # Copied into (tensors, mappings, state), rather than replaced.
            elif isinstance(value, MutableMapping) or is_stateful(value) or _holds_tensors(value):
                _pair(value, source[key], name, out)
            else:
                out.copies.append((_setter(target, key), source[key]))
    elif isinstance(target, MutableSequence):
        if not isinstance(source, list | tuple) or len(source) != len(target):
            out.mismatched.append(f"{prefix}: {len(target)} elements, kept {source!r:.60}")
            return
        for index, value in enumerate(target):
            if _holds_tensors(value):
                _pair(value, source[index], f"{prefix}.{index}", out)
            else:
                out.copies.append((_setter(target, index), source[index]))
    else:
        out.mismatched.append(f"{prefix}: a {type(target).__name__} holding tensors")


def _setter(container: Any, key: Any) -> Callable[[Any], object]:
    # A copy: never hand out what the pool will reuse.
    return lambda value: container.__setitem__(key, copy.deepcopy(value))
