"""What ranks and the coordinator remember of the last save plan, to reuse for the same layout.

A save plan depends on the state's *layout* (keys, shapes, dtypes, sharding) only, so a repeated
save of the same structure skips planning's exchange, deduplication, validation and metadata;
the values (fingerprints, audit sums) still travel every save. How
:class:`~dcp_safe.adapters.planners.SafeSavePlanner` uses this, the figures, and why not DCP's
``enable_plan_caching`` (it ignores dtypes, shares one class-wide cache, mixes earlier saves'
values in, keeps the old storage assignment): docs/architecture.md, "Cached save plans".

Consistency rule: a rank's entry and the coordinator's are taken out when planning starts and
put back only when the plan is finished (:data:`PlanCache`: ``pop``, then ``[key] =``). A save
that fails before then leaves that rank with nothing remembered, so its next save sends its
whole plan: a rank never claims a layout the coordinator no longer holds. Each scope (a process
group, saves without collectives, or one planner) has its own cache. Saves over one group do not
overlap; two concurrent saves in one process without collectives each take the entry or find
none, and the coordinator's part travels with its own rank's, so neither can be mismatched.

The global plan's metadata, cached or not, has its equal parts made one object
(:func:`with_shared_entries`), so ``.metadata`` pickles each once (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

Layout = tuple[Any, ...]


@dataclass(frozen=True)
class RankEntry:
    """One rank's last finished plan."""

    layout: Layout  # layout_of its local plan
    final: SavePlan  # the plan it wrote with (its storage assignment is replaced every save)
    token: int  # the coordinator's token for the global plan final came from


@dataclass(frozen=True)
class GlobalEntry:
    """The coordinator's last global plan: its token, every rank's local plan, the plans
    scattered to the ranks and DCP's metadata, all without values (audit sums, storage data)."""

    token: int
    local_plans: tuple[SavePlan, ...]
    global_plan: tuple[SavePlan, ...]
    metadata: Metadata


#: One scope's entries, by planner configuration: a rank's entry and (on the coordinator) the
#: global plan, taken out with ``pop`` and put back with ``[key] =``, each atomic on a dict.
PlanCache = dict[Hashable, tuple[RankEntry, GlobalEntry | None]]


_lock = threading.Lock()
_per_group: weakref.WeakKeyDictionary[Any, PlanCache] = weakref.WeakKeyDictionary()
_single_process = PlanCache()
_tokens = itertools.count(1)


def cache_for(group: Any) -> PlanCache:
    """The cache shared by every save over ``group`` in this process (``None``: saves without
    collectives); it goes with the group."""
    if group is None:
        return _single_process
    with _lock:
        return _per_group.setdefault(group, PlanCache())


def new_token() -> int:
    """A token no earlier global plan of this process had."""
    with _lock:
        return next(_tokens)


def layout_of(plan: SavePlan) -> Layout:
    """Everything of a local plan the global plan depends on, as plain comparable values.

    Field by field rather than the plan's dataclasses compared (about 40x slower at 10,000
    items); it includes the tensor properties (dtype, layout, ...) that DCP's own plan
    comparison leaves out, and the flattening mappings.
    """
    # torch.Size is a tuple, enums compare by identity: nothing needs converting.
    items = tuple(
        (i.index.fqn, i.index.offset, i.index.index, i.type, _tensor_layout(i.tensor_data))
        for i in plan.items
    )
    mappings = plan.planner_data
    return (items, tuple(mappings.items()) if isinstance(mappings, dict) else mappings)


def _tensor_layout(data: Any) -> tuple[Any, ...] | None:
    if data is None:
        return None
    props, chunk = data.properties, data.chunk
    kept = (props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory)
    return (data.size, *kept, chunk.offsets, chunk.sizes)


def with_shared_entries(metadata: Metadata) -> Metadata:
    """``metadata`` with its ``state_dict_metadata`` rebuilt from shared equal parts (the
    entries of any other type kept as they are): nobody changes them once planned (DCP's
    readers do not)."""
    seen: dict[tuple[Any, ...], Any] = {}

    def size(value: Any) -> Any:
        # torch.Size is a tuple: its elements key it (a plain tuple of the same ints too, so
        # the type is part of the key).
        return seen.setdefault((type(value), *value), value)

    entries: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        props = getattr(entry, "properties", None)
        if type(entry) is not TensorStorageMetadata or type(props) is not TensorProperties:
            entries[key] = entry
            continue
        fields = (props.dtype, props.layout, props.requires_grad, props.memory_format)
        shared = seen.setdefault((TensorProperties, *fields, props.pin_memory), props)
        chunks = [
            ChunkStorageMetadata(size(c.offsets), size(c.sizes))
            if type(c) is ChunkStorageMetadata
            else c
            for c in entry.chunks
        ]
        entries[key] = TensorStorageMetadata(shared, size(entry.size), chunks)
    return dataclasses.replace(metadata, state_dict_metadata=entries)
