"""DCP planners that keep each rank's state its own: divergence refused, per-rank state declared.

:class:`SafeSavePlanner` fingerprints every entry DCP would deduplicate and fails the save with
:class:`~dcp_safe.errors.DivergentStateError` where ranks differ; ``per_rank=`` prefixes are
stored once per rank. :class:`SafeLoadPlanner` maps them back, restores only the keys asked for
and reports what it did (:class:`RestoreReport`). A planner, because only there do all ranks'
plans meet before DCP deduplicates. Behaviour and the world-size rule: docs/resume.md.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from dcp_safe import layout
from dcp_safe.dcp import audit
from dcp_safe.dcp.audit import Piece
from dcp_safe.dcp.broadcast import SentObjects, object_key
from dcp_safe.dcp.read_once import (
    ReadOncePlan,
    Transfer,
    dtype_name,
    item_nbytes,
    items_digest,
    share_reads,
)
from dcp_safe.errors import ConfigError, DivergentStateError, MissingKeysError, PerRankStateError

__all__ = [
    "FingerprintedPlan",
    "RestoreReport",
    "SafeLoadPlanner",
    "SafeSavePlanner",
    "divergent_keys",
    "fingerprint",
    "fingerprints_of",
]


@dataclass(frozen=True)
class FingerprintedPlan(SavePlan):
    """A local save plan with the fingerprints of the entries DCP would deduplicate.

    Attributes:
        fingerprints: flattened key -> fingerprint, for plain tensors and objects.
        audit: every tensor's pieces on this rank, with their block fingerprints
            (:mod:`dcp_safe.dcp.audit`), for audited restores.
    """

    fingerprints: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    audit: dict[str, list[Piece]] = field(default_factory=dict)


class RestoreReport(str):
    """What a restore did: the checkpoint's name (a ``str``, as ``restore`` returned before),
    with what was restored, skipped and missing, as flattened keys, sorted.

    Attributes:
        name: the checkpoint loaded.
        restored: keys loaded into the state dict.
        skipped: keys of the state dict left alone on request (``keys=``/``exclude=``).
        missing: keys of the state dict the checkpoint does not hold (left alone; an error
            unless ``allow_partial=True``).
        unexpected: keys of the checkpoint the state dict did not ask for.
        audited: tensors checked against their saved fingerprints (``audit=True``), as stored
            (a per-rank entry under its rank's key).
    """

    name: str
    restored: tuple[str, ...]
    skipped: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    audited: tuple[str, ...]

    def __new__(
        cls,
        name: str,
        *,
        restored: Iterable[str] = (),
        skipped: Iterable[str] = (),
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
    ) -> RestoreReport:
        report = super().__new__(cls, name)
        report.name = name
        report.restored = tuple(sorted(restored))
        report.skipped = tuple(sorted(skipped))
        report.missing = tuple(sorted(missing))
        report.unexpected = tuple(sorted(unexpected))
        report.audited = ()
        return report

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {k: getattr(self, k) for k in ("restored", "skipped", "missing", "unexpected")}
        return (_rebuild_report, (self.name, fields))


def _rebuild_report(name: str, fields: dict[str, tuple[str, ...]]) -> RestoreReport:
    return RestoreReport(name, **fields)


class SafeSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing divergent state and storing per-rank state per rank.

    Args:
        per_rank: key prefixes (of the flattened state dict) saved once per rank.
        check_divergence: compare the ranks' fingerprints (off: DCP's behaviour, one copy kept).
        record_audit: record every tensor's block fingerprints in the checkpoint's metadata,
            for ``load(..., audit=True)``.

    Raises:
        ConfigError: a per-rank entry is a DTensor or ShardedTensor (already per rank by shard).
    """

    def __init__(
        self,
        *,
        per_rank: Sequence[str] = (),
        check_divergence: bool = True,
        record_audit: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.per_rank = _prefixes(per_rank)
        self.check_divergence = check_divergence
        self.record_audit = record_audit
        self.rank = 0

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.rank = _rank()
        for key in [k for k in self.state_dict if _matches(k, self.per_rank)]:
            value = self.state_dict[key]
            if isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor":
                raise ConfigError(
                    f"per_rank entry {key!r} is a {type(value).__name__}: it is saved per shard"
                    " already; declare only plain tensors and objects per rank"
                )
            _rename(self, key, layout.per_rank_key(key, self.rank))

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        fingerprints: dict[str, int] = {}
        if self.check_divergence:
            fingerprints = fingerprints_of(
                {
                    item.index.fqn: self.state_dict[item.index.fqn]
                    for item in plan.items
                    if item.type in (WriteItemType.TENSOR, WriteItemType.BYTE_IO)
                }
            )
        pieces = audit.report(self.state_dict, self.rank) if self.record_audit else {}
        self.plan = FingerprintedPlan(
            **_fields(plan), fingerprints=fingerprints, rank=self.rank, audit=pieces
        )
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        if self.record_audit:
            sums = audit.combine(p.audit for p in all_plans if isinstance(p, FingerprintedPlan))
            recorded = dict(metadata.planner_data or {})
            recorded[layout.AUDIT_KEY] = sums
            self.metadata = metadata = dataclasses.replace(metadata, planner_data=recorded)
        # Used up here: the plans scattered back to the ranks need not carry them.
        plans = [
            dataclasses.replace(p, fingerprints={}, audit={})
            if isinstance(p, FingerprintedPlan)
            else p
            for p in plans
        ]
        return plans, metadata

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # On the coordinator, with every rank's plan, before DCP keeps one copy of each key.
        differing = divergent_keys(all_plans)
        if differing:
            raise DivergentStateError(differing)
        return super()._dedup_save_plans(all_plans)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, giving each rank its own per-rank state, restoring only the
    keys asked for, and reporting what it did (:attr:`report`).

    Args:
        per_rank: the key prefixes saved per rank (as given to :class:`SafeSavePlanner`).
        keys: restore only these keys (or prefixes); ``None``: every key of the state dict.
        exclude: leave these keys (or prefixes) alone.
        allow_partial: a key asked for that the checkpoint lacks is left alone, not an error.
        name: the checkpoint's name, for the report.
        read_once: entries several ranks load identically are read from storage by one of
            them and sent to the others (:mod:`dcp_safe.dcp.read_once`). ``None`` (the
            default): on with several ranks when loaded by :func:`dcp_safe.load` (which sends
            them) from a reader without a node cache; ``True``: on, also with a node cache;
            ``False``: every rank reads everything it needs itself.

    Raises (from :meth:`set_up_planner`, on every rank):
        MissingKeysError: keys asked for are not in the checkpoint (without ``allow_partial``).
        PerRankStateError: per-rank entries were saved by another world size.
        ConfigError: ``read_once=True`` with several ranks in a load that is not
            :func:`dcp_safe.load`'s, or on a group without gloo.
    """

    def __init__(
        self,
        *,
        per_rank: Sequence[str] = (),
        keys: Collection[str] | None = None,
        exclude: Collection[str] = (),
        allow_partial: bool = False,
        name: str = "",
        read_once: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(allow_partial_load=True, **kwargs)
        self.read_once = read_once
        # Set by dcp_safe.load, which sends the shared entries once DCP's load returns.
        self.sends_shared = False
        self.transfers: list[Transfer] = []
        self._sent = SentObjects()
        #: Bytes the last load received from other ranks instead of reading them.
        self.bytes_received = 0
        self.per_rank = _prefixes(per_rank)
        self.keys = None if keys is None else _prefixes(keys)
        self.exclude = _prefixes(exclude)
        self.allow_partial = allow_partial
        self.report = RestoreReport(name)
        self._per_rank_keys: dict[str, str] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        stored = set(metadata.state_dict_metadata) if metadata is not None else set()
        wanted = {
            k for k in self.state_dict if _matches(k, self.keys) and not _matches(k, self.exclude)
        }
        skipped = set(self.state_dict) - wanted
        for key in skipped:
            self._forget(key)
        self._map_per_rank(stored)
        if self.read_once and not self.sends_shared and _world_size() > 1:
            raise ConfigError(
                "read_once=True needs dcp_safe.load (on a group with gloo), which sends the"
                " entries read once to the other ranks; otherwise pass read_once=False"
            )
        self.transfers, self._sent = [], SentObjects()
        missing = {k for k in wanted if self._stored_key(k) not in stored}
        if missing and not self.allow_partial:
            raise MissingKeysError(sorted(missing))
        for key in missing:
            self._forget(key)
        asked = {self._stored_key(k) for k in wanted}
        unexpected = (
            {layout.per_rank_base(k) or k for k in stored if k not in asked} - set(wanted) - skipped
        )
        self.report = RestoreReport(
            self.report.name,
            restored=wanted - missing,
            skipped=skipped,
            missing=missing,
            unexpected=unexpected,
        )

    def _map_per_rank(self, stored: set[str]) -> None:
        """Point this rank's per-rank keys at its own stored entries."""
        world = _world_size()
        for key in [k for k in self.state_dict if _matches(k, self.per_rank)]:
            saved = sorted(layout.per_rank_ranks(key, stored))
            if not saved:
                continue  # saved as one entry (equal on every rank, or before per_rank)
            if saved != list(range(world)):
                raise PerRankStateError(key, saved_ranks=saved, world_size=world)
            own = layout.per_rank_key(key, _rank())
            _rename(self, key, own)
            self._per_rank_keys[key] = own

    def create_local_plan(self) -> LoadPlan:
        # Not DefaultLoadPlanner's: its torch 2.3 key fallback re-flattens the whole state dict,
        # loading keys excluded here (dcp_safe checkpoints are written by torch >= 2.4 only).
        assert self.metadata is not None
        plan = create_default_local_load_plan(self.state_dict, self.metadata, strict=False)
        if not self.sends_shared or self.read_once is False:
            return plan
        dtypes = [
            None if i.type == LoadItemType.BYTE_IO else dtype_name(self.resolve_tensor(i).dtype)
            for i in plan.items
        ]
        return ReadOncePlan(
            items=plan.items,
            storage_data=plan.storage_data,
            planner_data=plan.planner_data,
            dtypes=dtypes,
            items_digest=items_digest(plan.items),
        )

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return share_reads(super().create_global_plan(global_plan), self._read_cost)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        if isinstance(new_plan, ReadOncePlan):
            self.transfers = new_plan.transfers
            # The objects this rank reads that others receive: kept when loaded, until sent.
            mine = {object_key(i) for i in new_plan.items}
            self._sent = SentObjects(
                {object_key(i) for t in self.transfers if t.objects for i in t.items} & mine
            )
        return super().finish_plan(new_plan)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._sent.keep(read_item, value)
        super().load_bytes(read_item, value)

    def sent_objects(self) -> SentObjects:
        """The object streams this rank read for others (kept until they are sent)."""
        return self._sent

    def _read_cost(self, item: ReadItem) -> int:
        """Bytes read from storage for ``item``: its stored length where the metadata says."""
        storage = getattr(self.metadata, "storage_data", None)
        info = storage.get(item.storage_index) if isinstance(storage, dict) else None
        length = getattr(info, "length", None)
        return int(length) if isinstance(length, int) else item_nbytes(item, None)

    def _stored_key(self, key: str) -> str:
        return self._per_rank_keys.get(key, key)

    def _forget(self, key: str) -> None:
        self.state_dict.pop(key, None)
        self.mappings.pop(key, None)


def divergent_keys(plans: Sequence[SavePlan]) -> dict[str, list[list[int]]]:
    """Keys whose fingerprints differ between ranks: key -> the ranks grouped by value.

    Plans without fingerprints (another planner) are left out of the comparison.
    """
    seen: dict[str, dict[int, list[int]]] = {}
    for plan in plans:
        if not isinstance(plan, FingerprintedPlan):
            continue
        for key, digest in plan.fingerprints.items():
            seen.setdefault(key, {}).setdefault(digest, []).append(plan.rank)
    return {
        key: sorted(sorted(ranks) for ranks in groups.values())
        for key, groups in sorted(seen.items())
        if len(groups) > 1
    }


#: Tensors of at least this many bytes are hashed on a thread pool (xxhash releases the GIL
#: while it hashes a buffer); smaller ones cost less than handing them to a thread.
_PARALLEL_BYTES = 4 << 20


def fingerprints_of(values: dict[str, object]) -> dict[str, int]:
    """:func:`fingerprint` of each value, the large tensors hashed in parallel (1 GiB on one
    thread: about 0.14 s, a quarter of a page-cache save)."""
    large = [
        key
        for key, value in values.items()
        if isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.numel() * value.element_size() >= _PARALLEL_BYTES
    ]
    found: dict[str, int] = {}
    if len(large) > 1:
        workers = min(len(large), os.cpu_count() or 1, 8)
        with ThreadPoolExecutor(workers, thread_name_prefix="dcp_safe-fingerprint") as pool:
            found = dict(zip(large, pool.map(fingerprint, (values[k] for k in large)), strict=True))
    return {
        key: found[key] if key in found else fingerprint(value) for key, value in values.items()
    }


def fingerprint(value: object) -> int:
    """An xxh3-64 digest of ``value``: a tensor's dtype, shape and bytes; an object's canonical
    encoding (``pickle`` alone is not canonical across processes: a tensor in it pickles with
    a random serialization id). It catches accidents, not a rank that lies."""
    hasher = xxhash.xxh3_64()
    _feed(hasher, value, depth=0)
    return int(hasher.intdigest())


def _feed(hasher: Any, value: object, depth: int) -> None:
    if depth > 64:
        raise ConfigError("state nested more than 64 levels deep cannot be fingerprinted")
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        flat = value.detach().reshape(-1).contiguous().cpu()
        hasher.update(f"T{flat.dtype}{tuple(value.shape)}".encode())
        hasher.update(flat.view(torch.uint8).numpy().data)
    elif isinstance(value, io.BytesIO):
        hasher.update(b"B")
        hasher.update(value.getbuffer())
    elif isinstance(value, dict):
        hasher.update(f"D{len(value)}".encode())
        for key, item in value.items():  # insertion order is part of the value DCP saves
            _feed(hasher, key, depth + 1)
            _feed(hasher, item, depth + 1)
    elif isinstance(value, (list, tuple)):
        hasher.update(f"{type(value).__name__[0]}{len(value)}".encode())
        for item in value:
            _feed(hasher, item, depth + 1)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        hasher.update(f"{type(value).__name__}:{value!r}".encode())
    else:
        try:
            hasher.update(pickle.dumps(value, protocol=4))
        except Exception:  # the save fails where DCP writes it, with DCP's own error
            hasher.update(f"unpicklable {type(value).__qualname__}".encode())


def _fields(plan: SavePlan) -> dict[str, Any]:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(SavePlan)}


def _rename(planner: DefaultSavePlanner | DefaultLoadPlanner, key: str, stored: str) -> None:
    """Store the state dict's entry ``key`` (and its mapping) under ``stored``."""
    planner.state_dict[stored] = planner.state_dict.pop(key)
    if key in planner.mappings:
        planner.mappings[stored] = planner.mappings.pop(key)


def _prefixes(keys: Iterable[str]) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise ConfigError(f"keys are a sequence of key prefixes, not one string: {keys!r}")
    found = tuple(keys)
    for key in found:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"a key prefix must be a non-empty string, got {key!r}")
    return found


def _matches(key: str, prefixes: tuple[str, ...] | None) -> bool:
    """``key`` is one of ``prefixes`` or below one (``None``: every key matches)."""
    if prefixes is None:
        return True
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
