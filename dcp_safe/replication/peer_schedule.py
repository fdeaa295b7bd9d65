"""Who sends which files to whom in the peer tier: pure functions of what every rank reported.

Every rank computes the same schedule from the same gathered reports, so the schedule itself
needs no message. Transfers are numbered; each rank sends its transfers in that order on one
thread and receives its own in that order on another, which cannot deadlock: the lowest
numbered transfer not yet done has both its ends free to do it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyTransfer:
    """Node ``node``'s files, sent by its leader ``src`` to the leader ``dst`` of a buddy node."""

    tag: int
    src: int
    dst: int
    node: int
    files: tuple[tuple[str, int], ...]  # (path in the checkpoint, size)


@dataclass(frozen=True)
class Fetch:
    """``file`` (``size`` bytes), sent by ``holder`` to ``requester`` during a restore."""

    tag: int
    file: str
    size: int
    holder: int
    requester: int


def node_leaders(nodes: Sequence[int]) -> dict[int, int]:
    """Each node's lowest rank (``nodes[rank]`` is the node of ``rank``)."""
    return {node: rank for rank, node in reversed(list(enumerate(nodes)))}


def buddies(node: int, nodes: Sequence[int], copies: int) -> list[int]:
    """The ``copies - 1`` nodes after ``node`` in node order, wrapping around: each node's
    files land on distinct other nodes, so losing one node never takes every copy."""
    order = sorted(set(nodes))
    at = order.index(node)
    return [order[(at + step) % len(order)] for step in range(1, copies)]


def copy_plan(
    nodes: Sequence[int], offers: Sequence[Sequence[tuple[str, int]] | None], copies: int
) -> list[CopyTransfer]:
    """The transfers of one save: each node's offered files (its leader's offer; ``None`` or
    empty: nothing to send) to its buddies' leaders."""
    leaders = node_leaders(nodes)
    sent = [
        (n, b) for n in sorted(leaders) if offers[leaders[n]] for b in buddies(n, nodes, copies)
    ]
    return [
        CopyTransfer(tag, leaders[n], leaders[b], n, tuple(offers[leaders[n]] or ()))
        for tag, (n, b) in enumerate(sent)
    ]


def fetch_plan(
    needs: Sequence[Mapping[str, int]],
    offers: Sequence[frozenset[str] | set[str]],
    tried: Sequence[Mapping[str, Sequence[str]]] = (),
    disks: Sequence[str] = (),
) -> list[Fetch]:
    """The transfers of one restore round: each file a rank needs (``needs[rank]``: file ->
    size) from a rank that offers it, the one with the fewest bytes to send so far (then the
    lowest rank).

    ``disks[rank]`` names the disk a rank's offers are on (ranks of one node share one; default:
    one each), and ``tried[rank]`` (file -> disks) the copies a rank already rejected: a rank is
    never asked again for a copy on a disk it tried, since it is the same copy.

    A file its own rank offers (a peer copy on its own node's disk) needs no transfer, and one
    no untried disk offers none either: both are left out, and the requester reads them from its
    disk or the remote.
    """
    disk_of = list(disks) or [str(rank) for rank in range(len(offers))]
    load = [0] * len(offers)
    fetches: list[Fetch] = []
    for requester, wanted in enumerate(needs):
        done = tried[requester] if tried else {}
        for file in sorted(wanted):
            if file in offers[requester]:
                continue
            excluded = set(done.get(file, ()))
            holders = [
                r for r, held in enumerate(offers) if file in held and disk_of[r] not in excluded
            ]
            if not holders:
                continue
            holder = min(holders, key=lambda rank: (load[rank], rank))
            load[holder] += wanted[file]
            fetches.append(Fetch(len(fetches), file, wanted[file], holder, requester))
    return fetches
