"""Send each shared entry from the rank that read it to the ranks that need it, after the load.

:mod:`dcp_safe.reading.read_once` planned who reads what; this runs once DCP's load has returned on
every rank (so every owner's reads succeeded, verified by the reader). Point-to-point sends on
the load's own group, not broadcasts: an entry reaches exactly the ranks that asked for it (with
HSDP, a shard's replicas, not the whole group), and ranks not involved in a transfer do not wait
on it. Every send and receive is posted before any is waited on, each with a tag the plan
assigned, so the order ranks get to them cannot deadlock; each wait is bounded by the group's
timeout, and a peer lost meanwhile raises the transport's error (translated by the caller).

A transfer's tensors travel in one buffer, each at a 16-byte aligned offset, as their
destination dtype (the plan matched it on both ends); an entry that is a whole contiguous CPU
tensor alone in its transfer goes straight from and into its tensor. Objects travel as the
sanitized stream the owner's planner loaded, so each receiver unpickles exactly what the owner
did: first their lengths, then their bytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from dcp_safe.reading.read_once import Transfer

__all__ = ["ObjectKey", "SentObjects", "deliver_shared", "object_key"]

_ALIGN = 16

#: The key an object entry is kept under on its owner until it is sent.
ObjectKey = tuple[str, tuple[int, ...] | None]


def object_key(item: ReadItem) -> ObjectKey:
    offset = item.dest_index.offset
    return (item.dest_index.fqn, None if offset is None else tuple(offset))


@dataclass
class SentObjects:
    """The object streams an owner loaded and must still send, by :func:`object_key`."""

    wanted: set[ObjectKey] = field(default_factory=set)
    payloads: dict[ObjectKey, bytes] = field(default_factory=dict)

    def keep(self, item: ReadItem, stream: io.BytesIO) -> None:
        key = object_key(item)
        if key in self.wanted:
            self.payloads[key] = stream.getvalue()


@dataclass
class _Pending:
    """Posted operations, and what to do with the received bytes once they are waited on."""

    works: list[Any] = field(default_factory=list)
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    unpack: list[Callable[[], None]] = field(default_factory=list)
    received_bytes: int = 0


def deliver_shared(
    planner: LoadPlanner,
    transfers: list[Transfer],
    sent: SentObjects,
    *,
    rank: int,
    group: Any,
    timeout_s: float | None,
) -> int:
    """Send this rank's entries and receive the others' into ``planner``'s state dict.

    Returns:
        The bytes this rank received (tensors and objects).
    """
    # A zero timeout is the default argument of Work.wait: no bound beyond the group's own.
    timeout = timedelta(seconds=timeout_s or 0)
    pending = _Pending()
    for transfer in transfers:
        if transfer.owner == rank:
            _post_sends(planner, transfer, sent.payloads, group, pending)
    object_sizes: list[tuple[Transfer, torch.Tensor, Any]] = []
    for transfer in transfers:
        if transfer.owner == rank:
            continue
        if transfer.objects:
            sizes = torch.empty(len(transfer.items), dtype=torch.int64)
            work = dist.irecv(sizes, group=group, tag=2 * transfer.tag, group_src=transfer.owner)
            object_sizes.append((transfer, sizes, work))
        else:
            _post_tensor_receive(planner, transfer, group, pending)
    for transfer, sizes, work in object_sizes:
        work.wait(timeout)
        _post_object_receive(planner, transfer, sizes, group, pending)
    for work in pending.works:
        work.wait(timeout)
    for unpack in pending.unpack:
        unpack()
    return pending.received_bytes


def _tensor_buffer(
    planner: LoadPlanner, items: tuple[ReadItem, ...]
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor] | None]:
    """A tensor transfer's regions and the bytes they travel in: the one region itself where it
    can be sent from or received into directly (no slots), else a new buffer holding each
    region's slot at a 16-byte aligned offset."""
    regions = [planner.resolve_tensor(item).detach() for item in items]
    one = regions[0] if len(regions) == 1 else None
    if one is not None and one.device.type == "cpu" and one.is_contiguous() and one.numel():
        return regions, one.reshape(-1).view(torch.uint8), None
    offsets, end = [], 0
    for region in regions:
        end = -(-end // _ALIGN) * _ALIGN
        offsets.append(end)
        end += region.numel() * region.element_size()
    buffer = torch.empty(max(end, 1), dtype=torch.uint8)
    slots = [
        buffer[at : at + r.numel() * r.element_size()].view(r.dtype).view(r.shape)
        for at, r in zip(offsets, regions, strict=True)
    ]
    return regions, buffer, slots


def _post_sends(
    planner: LoadPlanner,
    transfer: Transfer,
    payloads: Mapping[ObjectKey, bytes],
    group: Any,
    pending: _Pending,
) -> None:
    if transfer.objects:
        streams = [payloads[object_key(item)] for item in transfer.items]
        sizes = torch.tensor([len(s) for s in streams], dtype=torch.int64)
        data = torch.frombuffer(bytearray(b"".join(streams)) or bytearray(1), dtype=torch.uint8)
        pending.keep_alive += [sizes, data]
        for dest in transfer.dests:
            pending.works.append(
                dist.isend(sizes, group=group, tag=2 * transfer.tag, group_dst=dest)
            )
            if sum(len(s) for s in streams):
                pending.works.append(
                    dist.isend(data, group=group, tag=2 * transfer.tag + 1, group_dst=dest)
                )
        return
    regions, buffer, slots = _tensor_buffer(planner, transfer.items)
    for slot, region in zip(slots or [], regions, strict=False):
        slot.copy_(region)
    pending.keep_alive.append(buffer)
    for dest in transfer.dests:
        pending.works.append(dist.isend(buffer, group=group, tag=2 * transfer.tag, group_dst=dest))


def _post_tensor_receive(
    planner: LoadPlanner, transfer: Transfer, group: Any, pending: _Pending
) -> None:
    regions, buffer, slots = _tensor_buffer(planner, transfer.items)
    pending.received_bytes += sum(r.numel() * r.element_size() for r in regions)
    pending.keep_alive.append(buffer)
    pending.works.append(
        dist.irecv(buffer, group=group, tag=2 * transfer.tag, group_src=transfer.owner)
    )

    def unpack() -> None:
        for item, region, slot in zip(transfer.items, regions, slots or regions, strict=True):
            if slot is not region:
                region.copy_(slot)
            planner.commit_tensor(item, region)

    pending.unpack.append(unpack)


def _post_object_receive(
    planner: LoadPlanner, transfer: Transfer, sizes: torch.Tensor, group: Any, pending: _Pending
) -> None:
    lengths = [int(n) for n in sizes.tolist()]
    data = torch.empty(max(sum(lengths), 1), dtype=torch.uint8)
    pending.received_bytes += sum(lengths)
    if sum(lengths):
        pending.works.append(
            dist.irecv(data, group=group, tag=2 * transfer.tag + 1, group_src=transfer.owner)
        )

    def unpack() -> None:
        raw = data.numpy().tobytes()
        at = 0
        for item, length in zip(transfer.items, lengths, strict=True):
            planner.load_bytes(item, io.BytesIO(raw[at : at + length]))
            at += length

    pending.unpack.append(unpack)
