"""Send each shared entry from the rank that read it to the ranks that need it, after the load.

:mod:`dcp_safe.reading.read_once` planned who reads what; this runs once DCP's load has returned on
every rank (every owner's reads succeeded, verified). Point-to-point sends on the load's group
(docs/multirank.md, "Restores read each entry once"), in two rounds (objects' lengths, then
every transfer's bytes), each posted whole before any of it is waited on, with tags from the
plan, so the order ranks get to them cannot deadlock; each wait is bounded by the group's
timeout, and a peer lost meanwhile raises the transport's error (translated by the caller).

A transfer's tensors travel in one buffer, each at a 16-byte aligned offset, as their
destination dtype (the plan matched it on both ends); a whole contiguous CPU tensor alone in its
transfer goes straight from and into its tensor. Objects travel as the sanitized stream the
owner's planner loaded, so each receiver unpickles exactly what the owner did.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from dcp_safe.reading.read_once import Transfer

if TYPE_CHECKING:
    from dcp_safe.adapters.planners import SafeLoadPlanner

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
        if (key := object_key(item)) in self.wanted:
            self.payloads[key] = stream.getvalue()


def deliver_shared(planner: SafeLoadPlanner, group: Any, timeout_s: float | None) -> int:
    """Send this rank's entries (its ``planner``'s transfers, objects dropped once sent) and
    receive the others' into ``planner``'s state dict; return the bytes this rank received."""
    transfers = planner.transfers
    sent = planner.sent_objects()
    rank = dist.get_rank(group)
    # A zero timeout is the default argument of Work.wait: no bound beyond the group's own.
    timeout = timedelta(seconds=timeout_s or 0)
    # Objects announce their lengths first (tag 2t): a receiver sizes its buffer by them.
    objects = [t for t in transfers if t.objects]
    lengths = {
        t.tag: torch.tensor(
            [len(sent.payloads[object_key(i)]) if t.owner == rank else 0 for i in t.items],
            dtype=torch.int64,
        )
        for t in objects
    }
    for work in [w for t in objects for w in _post(t, lengths[t.tag], rank, group, 0)]:
        work.wait(timeout)
    # Then every transfer's bytes travel as one buffer (tag 2t + 1), unpacked once all arrived.
    works, unpack, buffers, received = [], [], [], 0
    for t in transfers:
        if t.objects:
            buffer, nbytes, done = _object_buffer(planner, t, sent, lengths[t.tag].tolist(), rank)
        else:
            buffer, nbytes, done = _tensor_buffer(planner, t, rank)
        if nbytes:
            works += _post(t, buffer, rank, group, 1)
        buffers.append(buffer)
        if t.owner != rank:
            unpack.append(done)
            received += nbytes
    for work in works:
        work.wait(timeout)
    for done in unpack:
        done()
    sent.payloads.clear()
    return received


def _post(transfer: Transfer, buffer: torch.Tensor, rank: int, group: Any, part: int) -> list[Any]:
    """``buffer`` sent to each destination (this rank owns ``transfer``), or received."""
    tag = 2 * transfer.tag + part
    if transfer.owner == rank:
        return [dist.isend(buffer, group=group, tag=tag, group_dst=d) for d in transfer.dests]
    return [dist.irecv(buffer, group=group, tag=tag, group_src=transfer.owner)]


def _object_buffer(
    planner: LoadPlanner, transfer: Transfer, sent: SentObjects, sizes: list[int], rank: int
) -> tuple[torch.Tensor, int, Callable[[], None]]:
    """An object transfer's bytes (the owner's streams, one after another), their count, and
    how a receiver hands each stream to the planner."""
    if transfer.owner == rank:
        joined = b"".join(sent.payloads[object_key(item)] for item in transfer.items)
        data = torch.frombuffer(bytearray(joined) or bytearray(1), dtype=torch.uint8)
        return data, sum(sizes), lambda: None
    buffer = torch.empty(max(sum(sizes), 1), dtype=torch.uint8)

    def unpack() -> None:
        raw, at = buffer.numpy().tobytes(), 0
        for item, length in zip(transfer.items, sizes, strict=True):
            planner.load_bytes(item, io.BytesIO(raw[at : at + length]))
            at += length

    return buffer, sum(sizes), unpack


def _tensor_buffer(
    planner: LoadPlanner, transfer: Transfer, rank: int
) -> tuple[torch.Tensor, int, Callable[[], None]]:
    """A tensor transfer's bytes, their count, and how a receiver commits each region to the
    planner: the one region itself where it can be sent from or received into directly, else a
    new buffer holding each region at a 16-byte aligned offset (filled here on the owner)."""
    regions = [planner.resolve_tensor(item).detach() for item in transfer.items]
    sizes = [r.numel() * r.element_size() for r in regions]
    one = regions[0]
    if len(regions) == 1 and one.device.type == "cpu" and one.is_contiguous() and one.numel():
        buffer, slots = one.reshape(-1).view(torch.uint8), regions
    else:
        offsets, end = [], 0
        for size in sizes:
            end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            end += size
        buffer = torch.empty(max(end, 1), dtype=torch.uint8)
        slots = [
            buffer[at : at + n].view(r.dtype).view(r.shape)
            for at, n, r in zip(offsets, sizes, regions, strict=True)
        ]
    pairs = list(zip(regions, slots, strict=True))
    nbytes = sum(sizes)
    if transfer.owner == rank:
        for region, slot in pairs:
            if slot is not region:
                slot.copy_(region)
        return buffer, nbytes, lambda: None

    def unpack() -> None:
        for item, (region, slot) in zip(transfer.items, pairs, strict=True):
            if slot is not region:
                region.copy_(slot)
            planner.commit_tensor(item, region)

    return buffer, nbytes, unpack
