"""DCP planners that keep each rank's state its own: divergence refused, per-rank state declared.

:class:`SafeSavePlanner` fingerprints every entry DCP would deduplicate and fails the save with
:class:`~dcp_safe.errors.DivergentStateError` where ranks differ; ``per_rank=`` prefixes are
stored once per rank. :class:`SafeLoadPlanner` maps them back, restores only the keys asked for
and reports what it did (:class:`RestoreReport`). A planner, because only there do all ranks'
plans meet before DCP deduplicates. Behaviour and the world-size rule: docs/resume.md.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pickle
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from dcp_safe import layout
from dcp_safe.adapters.broadcast import SentObjects, object_key
from dcp_safe.adapters.plan_cache import (
    GlobalEntry,
    PlanCache,
    RankEntry,
    cache_for,
    layout_of,
    new_token,
    with_shared_entries,
)
from dcp_safe.errors import (
    CommitError,
    ConfigError,
    DivergentStateError,
    MissingKeysError,
    PerRankStateError,
)
from dcp_safe.reading import audit
from dcp_safe.reading.audit import Piece
from dcp_safe.reading.read_once import (
    ReadOncePlan,
    Transfer,
    items_digest,
    share_reads,
)
from dcp_safe.torch_compat import rank_world


@dataclass(frozen=True)
class FingerprintedPlan(SavePlan):
    """A local save plan with the :func:`fingerprint` of each entry DCP would deduplicate (by
    flattened key), and every tensor's pieces on this rank with their block fingerprints
    (``audit``, :mod:`dcp_safe.reading.audit`). ``plan_token``: on a local plan with no items
    (``usable=False``), its layout is the cached global plan's with this token; on a global plan,
    its token, for the rank to name it by next time (:mod:`dcp_safe.adapters.plan_cache`).
    """

    fingerprints: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    audit: dict[str, list[Piece]] = field(default_factory=dict)
    plan_token: int | None = None


class RestoreReport(str):
    """What a restore did: the checkpoint's name (a ``str``, as ``restore`` returned before),
    with what was restored, skipped and missing, as flattened keys, sorted."""

    name: str  # the checkpoint loaded
    restored: tuple[str, ...]  # keys loaded into the state dict
    skipped: tuple[str, ...]  # keys left alone on request (keys= / exclude=)
    # Keys the checkpoint does not hold (left alone; an error unless allow_partial=True).
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]  # keys of the checkpoint the state dict did not ask for
    # Tensors checked against their saved fingerprints (audit=True), as stored (a per-rank
    # entry under its rank's key), and those restored without fingerprints to check (warned).
    audited: tuple[str, ...]
    unaudited: tuple[str, ...]

    def __new__(cls, name: str, **keys: Iterable[str]) -> RestoreReport:
        """``keys``: any of the key attributes (default: none). A copy or pickle restores them
        from the instance's ``__dict__`` (``str``'s own reduction)."""
        report = super().__new__(cls, name)
        report.name = name
        for kind in _REPORTED:
            setattr(report, kind, tuple(sorted(keys.pop(kind, ()))))
        if keys:
            raise TypeError(f"RestoreReport has no {sorted(keys)}")
        return report


_REPORTED = ("restored", "skipped", "missing", "unexpected", "audited", "unaudited")


class SafeSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing divergent state and storing per-rank state per rank.

    Repeated saves of one layout reuse the last global plan and metadata (``cache_plans``;
    docs/architecture.md, "Cached save plans"): each rank sends only its values, and gets back an
    empty plan. The cache is this planner's own, or, after :meth:`share_plans_over`, every such
    planner's saving over that group (``dcp_safe.save``, ``async_save`` and the manager's).

    Args:
        per_rank: key prefixes (of the flattened state dict) saved once per rank.
        check_divergence: compare the ranks' fingerprints (off: DCP's behaviour, one copy kept).
        record_audit: record every tensor's block fingerprints, for ``load(..., audit=True)``.

    Raises:
        ConfigError: a per-rank entry is a DTensor or ShardedTensor (already per rank by shard);
            ``cache_plans`` is not a bool, or DCP's ``enable_plan_caching`` was asked for.
    """

    def __init__(
        self,
        *,
        per_rank: Sequence[str] = (),
        check_divergence: bool = True,
        record_audit: bool = True,
        cache_plans: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(cache_plans, bool):
            raise ConfigError(f"cache_plans is True or False, got {cache_plans!r}")
        if kwargs.get("enable_plan_caching"):
            raise ConfigError(
                "SafeSavePlanner caches plans itself (cache_plans=True, the default); DCP's"
                " enable_plan_caching would reuse another save's storage assignment: drop it"
            )
        super().__init__(**kwargs)
        self.per_rank = _prefixes(per_rank)
        self.check_divergence = check_divergence
        self.record_audit = record_audit
        self.cache_plans = cache_plans
        self.rank = 0
        self._cache = PlanCache()
        # This save's plan cache state: the local layout, what this rank and (on the coordinator)
        # the global plan were, taken out of the cache until finish_plan puts them back.
        self._layout: Any = None
        self._remembered: RankEntry | None = None
        self._global: GlobalEntry | None = None

    def share_plans_over(self, group: Any) -> None:
        """Share cached plans with every planner of this configuration saving over ``group``
        (``None``: saves without collectives) in this process."""
        self._cache = cache_for(group)

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.rank = rank_world()[0]
        for key in [k for k in self.state_dict if _matches(k, self.per_rank)]:
            value = self.state_dict[key]
            if isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor":
                raise ConfigError(
                    f"per_rank entry {key!r} is a {type(value).__name__}: it is saved per shard"
                    " already; declare only plain tensors and objects per rank"
                )
            _rename(self, key, layout.per_rank_key(key, self.rank))

    def create_local_plan(self) -> SavePlan:
        if self.cache_plans:  # taken before anything here can fail (plan_cache's rule)
            self._remembered, self._global = self._cache.pop(self._cache_key(), (None, None))
        plan = super().create_local_plan()
        fingerprints: dict[str, int] = {}
        if self.check_divergence and rank_world()[1] > 1:  # one rank has nothing to differ from
            plain = (WriteItemType.TENSOR, WriteItemType.BYTE_IO)
            keys = [item.index.fqn for item in plan.items if item.type in plain]
            fingerprints = fingerprints_of({key: self.state_dict[key] for key in keys})
        pieces = audit.report(self.state_dict, self.rank) if self.record_audit else {}
        self.plan = FingerprintedPlan(
            **vars(plan), fingerprints=fingerprints, rank=self.rank, audit=pieces
        )
        if not self.cache_plans:
            return self.plan
        self._layout = layout_of(plan)
        if self._remembered is not None and self._remembered.layout == self._layout:
            # The layout the coordinator already planned: send the values alone.
            token = self._remembered.token
            return dataclasses.replace(
                self.plan, items=[], planner_data=None, usable=False, plan_token=token
            )
        self._remembered = None
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # On the coordinator, with every rank's values, cached layout or not.
        if differing := divergent_keys(all_plans):
            raise DivergentStateError(differing)
        if (reused := self._reusable(all_plans)) is not None:
            plans: list[SavePlan] = [SavePlan([], usable=False) for _ in all_plans]
            self.global_plan = list(reused.global_plan)
            metadata = dataclasses.replace(reused.metadata)
        else:
            layouts = self._layouts(all_plans)
            plans, metadata = super().create_global_plan(layouts)
            metadata = with_shared_entries(metadata)
            if self.cache_plans:
                token = new_token()
                tokened = functools.partial(dataclasses.replace, plan_token=token)
                plans = [tokened(p) if isinstance(p, FingerprintedPlan) else p for p in plans]
                metadata = dataclasses.replace(metadata, storage_data=None)
                self._global = GlobalEntry(token, tuple(layouts), tuple(plans), metadata)
                metadata = dataclasses.replace(metadata)
        if self.record_audit:
            sums = audit.combine(p.audit for p in all_plans if isinstance(p, FingerprintedPlan))
            recorded = {**(metadata.planner_data or {}), layout.AUDIT_KEY: sums}
            metadata = dataclasses.replace(metadata, planner_data=recorded)
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not self.cache_plans:
            return super().finish_plan(new_plan)
        if new_plan.usable:
            token = new_plan.plan_token if isinstance(new_plan, FingerprintedPlan) else None
            final = new_plan
        elif self._remembered is not None:
            # The cached plan, with this save's storage assignment (the writer's, made after
            # the planner's global plan).
            token = self._remembered.token
            final = dataclasses.replace(self._remembered.final, storage_data=new_plan.storage_data)
        else:
            raise CommitError(f"rank {self.rank} got a cached save plan it does not hold")
        if token is not None:
            self._cache[self._cache_key()] = (RankEntry(self._layout, final, token), self._global)
        self._layout = self._remembered = self._global = None
        self.plan = final
        return final

    def _reusable(self, all_plans: list[SavePlan]) -> GlobalEntry | None:
        """The cached global plan, when every rank sent only its values for it."""
        cached = self._global
        if not self.cache_plans or cached is None or len(all_plans) != len(cached.local_plans):
            return None
        return cached if all(_token_of(p) == cached.token for p in all_plans) else None

    def _layouts(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """Every rank's local plan without values: sent, or named by a cached token."""
        cached, stale = self._global, []
        layouts: list[SavePlan] = []
        for rank, plan in enumerate(all_plans):
            if plan.usable and isinstance(plan, FingerprintedPlan):
                layouts.append(dataclasses.replace(plan, fingerprints={}, audit={}))
            elif plan.usable:
                layouts.append(plan)
            elif cached is not None and _token_of(plan) == cached.token:
                layouts.append(cached.local_plans[rank])
            else:
                stale.append(rank)
        if stale:
            # Cannot happen while ranks save in step (take/put in plan_cache); if it does, no
            # rank holds a cached plan after this failure, so the next save plans afresh.
            raise CommitError(
                "ranks sent a cached save plan the coordinator does not hold; save again",
                {r: "its cached save plan is not the coordinator's" for r in stale},
            )
        return layouts

    def _cache_key(self) -> tuple[Any, ...]:
        """What, besides the layout, decides the global plan."""
        return (
            type(self).__qualname__,
            self.per_rank,
            self.check_divergence,
            self.record_audit,
            self.flatten_state_dict,
            self.flatten_sharded_tensors,
            self.dedup_save_to_lowest_rank,
        )

    def __getstate__(self) -> dict[str, Any]:
        # A planner sent to another process (DCP's checkpoint process) caches there alone.
        return {**self.__dict__, "_cache": PlanCache()}


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, giving each rank its own per-rank state, restoring only the
    keys asked for, and reporting what it did (:attr:`report`).

    Args:
        per_rank: the key prefixes saved per rank (as given to :class:`SafeSavePlanner`).
        keys, exclude: restore only these keys (or prefixes; ``None``: all), but not those.
        allow_partial: a key asked for that the checkpoint lacks is left alone, not an error.
        read_once: entries several ranks load identically are read from storage by one of
            them and sent to the others (:mod:`dcp_safe.reading.read_once`). ``None`` (the
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
        self._per_rank_keys = {}  # this load's: a planner used again must not keep the last's
        stored = set(metadata.state_dict_metadata) if metadata is not None else set()
        wanted = {
            k for k in self.state_dict if _matches(k, self.keys) and not _matches(k, self.exclude)
        }
        skipped = set(self.state_dict) - wanted
        for key in skipped:
            self._forget(key)
        rank, world = rank_world()
        for key in [k for k in self.state_dict if _matches(k, self.per_rank)]:
            # This rank's per-rank keys point at its own stored entries.
            saved = sorted(layout.per_rank_ranks(key, stored))
            if not saved:
                continue  # saved as one entry (equal on every rank, or before per_rank)
            if saved != list(range(world)):
                raise PerRankStateError(key, saved_ranks=saved, world_size=world)
            own = layout.per_rank_key(key, rank)
            _rename(self, key, own)
            self._per_rank_keys[key] = own
        if self.read_once and not self.sends_shared and world > 1:
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
        unexpected = {layout.per_rank_base(k) or k for k in stored if k not in asked} - wanted
        self.report = RestoreReport(
            self.report.name,
            restored=wanted - missing,
            skipped=skipped,
            missing=missing,
            unexpected=unexpected - skipped,
        )

    def create_local_plan(self) -> LoadPlan:
        # Not DefaultLoadPlanner's: its torch 2.3 key fallback re-flattens the whole state dict,
        # loading keys excluded here (dcp_safe checkpoints are written by torch >= 2.4 only).
        assert self.metadata is not None
        plan = create_default_local_load_plan(self.state_dict, self.metadata, strict=False)
        if not self.sends_shared or self.read_once is False:
            return plan
        dtypes = [
            None if i.type == LoadItemType.BYTE_IO else str(self.resolve_tensor(i).dtype)
            for i in plan.items
        ]
        return ReadOncePlan(**vars(plan), dtypes=dtypes, items_digest=items_digest(plan.items))

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
        """Bytes read from storage for ``item``: its stored length where the reader's metadata
        says, else (a reader that keeps no lengths, as DCP's Hugging Face one) its region's bytes
        in the stored dtype; ``0`` for an object."""
        assert self.metadata is not None  # create_local_plan ran first, on this rank too
        storage = self.metadata.storage_data
        info = storage.get(item.storage_index) if isinstance(storage, dict) else None
        length = getattr(info, "length", None)
        if isinstance(length, int):
            return length
        stored = self.metadata.state_dict_metadata[item.storage_index.fqn]
        if not isinstance(stored, TensorStorageMetadata):
            return 0
        return math.prod(item.lengths) * stored.properties.dtype.itemsize

    def _stored_key(self, key: str) -> str:
        return self._per_rank_keys.get(key, key)

    def _forget(self, key: str) -> None:
        self.state_dict.pop(key, None)
        self.mappings.pop(key, None)


def divergent_keys(plans: Sequence[SavePlan]) -> dict[str, list[list[int]]]:
    """Keys whose fingerprints differ between ranks: key -> the ranks grouped by value (plans
    without fingerprints, another planner's, left out)."""
    seen: dict[str, dict[int, list[int]]] = {}
    for plan in [p for p in plans if isinstance(p, FingerprintedPlan)]:
        for key, digest in plan.fingerprints.items():
            seen.setdefault(key, {}).setdefault(digest, []).append(plan.rank)
    return {
        key: sorted(sorted(ranks) for ranks in groups.values())
        for key, groups in sorted(seen.items())
        if len(groups) > 1
    }


def _token_of(plan: SavePlan) -> int | None:
    return None if plan.usable or not isinstance(plan, FingerprintedPlan) else plan.plan_token


def _rename(planner: DefaultSavePlanner | DefaultLoadPlanner, key: str, stored: str) -> None:
    """Store the state dict's entry ``key`` (and its mapping) under ``stored``."""
    planner.state_dict[stored] = planner.state_dict.pop(key)
    if key in planner.mappings:
        planner.mappings[stored] = planner.mappings.pop(key)


def _prefixes(keys: Iterable[str]) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise ConfigError(f"keys are a sequence of key prefixes, not one string: {keys!r}")
    found = tuple(keys)
    if bad := [key for key in found if not isinstance(key, str) or not key]:
        raise ConfigError(f"a key prefix must be a non-empty string, got {bad[0]!r}")
    return found


def _matches(key: str, prefixes: tuple[str, ...] | None) -> bool:
    """``key`` is one of ``prefixes`` or below one (``None``: every key matches)."""
    return prefixes is None or any(key == p or key.startswith(p + ".") for p in prefixes)


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
    return {k: found[k] if k in found else fingerprint(v) for k, v in values.items()}


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
