"""Read once: each entry several ranks load identically is read from storage by one of them.

On the coordinator, with every rank's local load plan, a ``ReadItem`` that several ranks hold
with the same source, the same destination region and the same destination dtype is *shared*.
It stays in the plan of one of those ranks, its owner, and leaves the others'; owners are
chosen greedily, largest entry first, for the rank with the fewest bytes to read so far, so the
bytes read spread evenly. Every rank's plan then lists the transfers it takes part in, the same
on both ends; after DCP's load has succeeded on every rank, :mod:`dcp_safe.adapters.broadcast` sends
each owner's entries to the ranks that need them.

Why the coordinator's global plan: it is the one place all ranks' reads meet before any is
done, and DCP scatters its result back, so no extra collective decides who reads what. Why
after DCP's load and not inside ``read_data``: DCP gathers every rank's read result at its end,
so an owner's failed read already fails the load on every rank before anything is sent.
Entries a rank alone needs (a resharded DTensor's pieces, per-rank keys) are read as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

#: Entries sent between two ranks travel packed in buffers of up to this many bytes (fewer
#: messages for many small entries); a larger entry travels alone, straight from its tensor.
BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class Transfer:
    """Entries ``owner`` read and sends, in this order, to each of ``dests``; ``tag`` pairs
    sends with receives (unique within one load, the same on every rank); ``objects``: the
    entries are objects (sent pickled, all at once), not tensors."""

    tag: int
    owner: int
    dests: tuple[int, ...]
    items: tuple[ReadItem, ...]
    objects: bool = False


@dataclass
class ReadOncePlan(LoadPlan):
    """A load plan that knows which entries travel between ranks: ``dtypes``, the destination
    dtype per item (``None``: an object); ``items_digest`` of the items they describe (a planner
    subclass that edits the items leaves them undescribed, and nothing is shared); after the
    global plan, the ``transfers`` this rank takes part in, and whether entries were ``share``d
    at all (the same on every rank)."""

    dtypes: list[str | None] = field(default_factory=list)
    items_digest: int = 0
    transfers: list[Transfer] = field(default_factory=list)
    share: bool = False


def items_digest(items: Sequence[ReadItem]) -> int:
    """A digest of ``items`` that every process computes alike (``hash`` is salted)."""
    hasher = xxhash.xxh3_64()
    for item in items:
        hasher.update(repr(_identity(item, None)).encode())
    return int(hasher.intdigest())


def item_nbytes(item: ReadItem, dtype: str | None) -> int:
    """The bytes of a tensor item's destination region (``0`` for an object)."""
    if item.type == LoadItemType.BYTE_IO or dtype is None:
        return 0
    itemsize: int = getattr(torch, dtype.removeprefix("torch.")).itemsize
    return math.prod(item.lengths) * itemsize


def _identity(item: ReadItem, dtype: str | None) -> Hashable:
    """What two ranks' items must share for one's loaded values to serve the other."""
    dest, src = item.dest_index, item.storage_index
    return (
        item.type,
        dest.fqn,
        None if dest.offset is None else tuple(dest.offset),
        tuple(item.dest_offsets),
        src.fqn,
        None if src.offset is None else tuple(src.offset),
        tuple(item.storage_offsets),
        tuple(item.lengths),
        dtype,
    )


def share_reads(plans: Sequence[LoadPlan], read_bytes: Callable[[ReadItem], int]) -> list[LoadPlan]:
    """Every rank's plan (in rank order; unchanged unless each is a ``ReadOncePlan``) with each
    shared entry kept by its owner only, and its transfers; ``read_bytes``: an item's cost."""
    local = [
        p
        for p in plans
        if isinstance(p, ReadOncePlan)
        and len(p.dtypes) == len(p.items)
        and p.items_digest == items_digest(p.items)
    ]
    if len(plans) < 2 or len(local) != len(plans):
        return list(plans)
    holders: dict[Hashable, list[int]] = {}
    first: dict[Hashable, tuple[ReadItem, str | None]] = {}
    for rank, plan in enumerate(local):
        for item, dtype in zip(plan.items, plan.dtypes, strict=True):
            key = _identity(item, dtype)
            holders.setdefault(key, []).append(rank)
            first.setdefault(key, (item, dtype))
    owners = _owners(len(local), holders, first, read_bytes)
    transfers = _transfers(holders, first, owners)
    return [
        ReadOncePlan(
            items=[
                i
                for i, d in zip(p.items, p.dtypes, strict=True)
                if owners.get(_identity(i, d), r) == r
            ],
            storage_data=p.storage_data,
            planner_data=p.planner_data,
            transfers=[t for t in transfers if t.owner == r or r in t.dests],
            share=True,
        )
        for r, p in enumerate(local)
    ]


def _owners(
    world: int,
    holders: dict[Hashable, list[int]],
    first: dict[Hashable, tuple[ReadItem, str | None]],
    read_bytes: Callable[[ReadItem], int],
) -> dict[Hashable, int]:
    """The owner of each shared entry (of ``world`` ranks' plans): largest first, to the holder
    with the least to read (its own entries, then the shared ones it was given)."""
    load = [0] * world
    for key, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += read_bytes(first[key][0])
    shared = [key for key, ranks in holders.items() if len(ranks) > 1]
    cost = {key: read_bytes(first[key][0]) for key in shared}
    owners: dict[Hashable, int] = {}
    for key in sorted(shared, key=lambda k: -cost[k]):  # stable: ties keep plan order
        owner = min(holders[key], key=lambda r: (load[r], r))
        owners[key] = owner
        load[owner] += cost[key]
    return owners


def _transfers(
    holders: dict[Hashable, list[int]],
    first: dict[Hashable, tuple[ReadItem, str | None]],
    owners: dict[Hashable, int],
) -> list[Transfer]:
    """The shared entries grouped by (owner, receivers), tensors packed into batches of up to
    :data:`BATCH_BYTES` (objects, 0 bytes each by :func:`item_nbytes`, all in one)."""
    groups: dict[tuple[int, tuple[int, ...], bool], list[tuple[ReadItem, str | None]]] = {}
    for key, owner in owners.items():
        item = first[key][0]
        dests = tuple(r for r in holders[key] if r != owner)
        groups.setdefault((owner, dests, item.type == LoadItemType.BYTE_IO), []).append(first[key])
    transfers: list[Transfer] = []
    for (owner, dests, objects), entries in groups.items():
        batch: list[ReadItem] = []
        size = 0
        for item, dtype in entries:  # never empty
            nbytes = item_nbytes(item, dtype)
            if batch and size + nbytes > BATCH_BYTES:
                transfers.append(Transfer(len(transfers), owner, dests, tuple(batch), objects))
                batch, size = [], 0
            batch.append(item)
            size += nbytes
        transfers.append(Transfer(len(transfers), owner, dests, tuple(batch), objects))
    return transfers
