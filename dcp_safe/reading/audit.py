"""Fingerprints of tensors over fixed blocks of their *global* shape, from any sharding.

Save and restore are sharded differently (4 ranks then 2; row, column or replicated shards), so
the fingerprint must not depend on the cut. It is a sum over *sampled* elements of the global
tensor in row-major order:

    sample j is the element at global flat index  j * s,  s >= numel / MAX_SAMPLES
    F(block b) = sum over samples j in b of  bits(sample j) * W[j - b * L]

modulo 2**64, where ``bits`` is the element's raw bits as an integer, a block is ``L``
consecutive samples (the samples split into :data:`BLOCKS` blocks, so a block also says *where*
in the tensor a difference is) and ``W`` a fixed vector of random odd 64-bit weights.
Addition modulo 2**64 is exact, associative and commutative, so every rank sums the samples of
its own shard into per-block partials, and partials of disjoint shards add up to the block's
fingerprint whatever the cut. Equal bits give equal fingerprints (NaNs too).

What it catches and misses (placement, not a flipped byte between samples): docs/resume.md,
"A restore that proves itself".

Why not a hash of each block's bytes: a block cut across two ranks' shards has no single rank
that can hash it, and the save and the restore cut differently.

A restore that proves itself (:func:`audit_load`): every rank fingerprints the pieces it holds,
all ranks exchange them, and each compares the sums with those recorded at save: the same
verdict everywhere.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dcp_safe import layout
from dcp_safe.coordination.group import gather_objects
from dcp_safe.errors import ConfigError, RestoreMismatchError
from dcp_safe.torch_compat import dtensor_chunks, dtensor_local
from dcp_safe.untrusted import shown

if TYPE_CHECKING:  # the planner imports this module
    from dcp_safe.adapters.planners import SafeLoadPlanner

log = logging.getLogger(__name__)

MAX_SAMPLES = 1 << 10
"""Samples of one tensor at most (every element of a tensor up to this size)."""
BLOCKS = 16
"""Blocks a tensor's samples are split into (fewer when it has fewer elements)."""
_MAX_BLOCK_SAMPLES = MAX_SAMPLES // BLOCKS

_ROWS_PER_CHUNK = 1 << 14  # runs of a many-run piece handled at a time
_BATCH_ELEMENTS = 1 << 22  # elements of small tensors summed at once (32 MiB as int64)
_MASK = (1 << 64) - 1
_FOLD = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd constant, as a signed 64-bit integer


@dataclass(frozen=True)
class Box:
    """One rank's piece of a tensor: its first element's ``offsets`` in the global tensor (of
    ``global_shape``), and its ``local`` values."""

    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    local: torch.Tensor


def boxes(value: torch.Tensor) -> list[Box]:
    """The pieces of ``value`` this rank holds: the whole of a plain tensor, a DTensor's shard
    (a replica is a piece too: the caller decides which replica counts)."""
    if isinstance(value, DTensor):
        shape, local = tuple(value.shape), dtensor_local(value)
        return [Box(offsets, shape, local) for offsets, _ in dtensor_chunks(value)]
    return [Box((0,) * value.dim(), tuple(value.shape), value)]


def stride(shape: tuple[int, ...]) -> int:
    """Every how many elements of a tensor of ``shape`` one is sampled: at least
    ``numel / MAX_SAMPLES``, and coprime with every dimension but the first, so a piece cut
    along any dimension holds its share (a stride equal to a row's length samples column 0
    alone)."""
    numel = math.prod(shape)
    every = max(1, -(-numel // MAX_SAMPLES))
    while any(math.gcd(every, size) != 1 for size in shape[1:]):
        every += 1
    return every


def block_samples(shape: tuple[int, ...]) -> int:
    """Samples in each block of a tensor of ``shape``."""
    samples = -(-math.prod(shape) // stride(shape))
    return max(1, -(-samples // BLOCKS))


def partials(box: Box) -> dict[int, int]:
    """This piece's contribution to each block it touches: block index -> sum mod 2**64."""
    local = box.local.detach().cpu()
    sums: dict[int, int] = {}
    if local.numel() == 0:
        return sums
    every, length = stride(box.global_shape), block_samples(box.global_shape)
    starts, rows = _runs(box, _bits(local))  # the whole tensor: one run from 0
    if starts.numel() == 1:  # one run: its samples are a strided view of it
        first = -int(starts[0]) % every
        picked = rows[0][first::every]
        if picked.numel():
            begin = (int(starts[0]) + first) // every
            sample = torch.arange(picked.numel(), dtype=torch.int64) + begin
            _add_samples(sums, sample, picked, length, run=True)
    else:  # many runs, a chunk at a time: every element's global index, the sampled ones kept
        for at in range(0, starts.numel(), _ROWS_PER_CHUNK):
            chunk = slice(at, at + _ROWS_PER_CHUNK)
            index = starts[chunk, None] + torch.arange(rows.shape[1], dtype=torch.int64)[None, :]
            keep = index % every == 0
            if bool(keep.any()):
                _add_samples(sums, index[keep] // every, rows[chunk][keep], length)
    return {b: v & _MASK for b, v in sums.items()}


def _bits(local: torch.Tensor) -> torch.Tensor:
    """The elements' raw bits as integers, one per element, in the piece's shape."""
    local = local.contiguous()
    if local.dtype == torch.bool:
        return local.view(torch.uint8)
    size = local.element_size()
    if size == 16:  # complex128: fold its two 64-bit halves into one (wrapping) integer
        halves = local.view(torch.int64).reshape(*local.shape, 2)
        return halves[..., 0] * _FOLD + halves[..., 1]
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return local.view(kind)


def _runs(box: Box, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece as runs contiguous in the global flat order: each run's first global index
    (int64, one a run) and the runs' bits (one row a run)."""
    shape, offsets = box.global_shape, box.offsets
    if not shape:  # a scalar
        return torch.zeros(1, dtype=torch.int64), bits.reshape(1, 1)
    sizes = tuple(bits.shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # The trailing dimensions the piece spans whole merge with the one before into one run.
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k] and offsets[k] == 0:
        k -= 1
    length = math.prod(sizes[k:])
    starts = torch.tensor([offsets[k] * strides[k]], dtype=torch.int64)
    for d in range(k - 1, -1, -1):  # outer dimensions vary slowest: broadcast them in
        along = (torch.arange(sizes[d], dtype=torch.int64) + offsets[d]) * strides[d]
        starts = (along[:, None] + starts[None, :]).reshape(-1)
    return starts, bits.reshape(-1, length)


def _add_samples(
    sums: dict[int, int], sample: torch.Tensor, values: torch.Tensor, length: int, run: bool = False
) -> None:
    """Add samples (their indices, ascending, and their bits) into their blocks: a few vector
    operations whatever the number of blocks. Integer products and sums wrap: exact modulo
    2**64. A block with no sample is left out, unless the samples are one ``run`` (consecutive:
    each block between the first and the last holds some)."""
    weighted = values.to(torch.int64) * _weights()[sample % length]
    blocks = sample // length
    low = int(blocks[0]) if blocks.numel() else 0
    totals = torch.zeros(int(blocks.max()) - low + 1, dtype=torch.int64)
    totals.index_add_(0, blocks - low, weighted)
    for offset, total in enumerate(totals.tolist()):
        if total or run or (low + offset) in sums:
            sums[low + offset] = sums.get(low + offset, 0) + total


@functools.cache
def _weights() -> torch.Tensor:
    """Fixed random odd 64-bit weights (the same in every process: a fixed seed)."""
    generator = torch.Generator().manual_seed(0x5EED_DC95_AFE0)
    raw = torch.randint(-(1 << 62), 1 << 62, (_MAX_BLOCK_SAMPLES,), generator=generator)
    return raw * 2 + 1


#: One piece as a rank reports it: (rank, offsets, sizes, global shape, block -> partial sum).
Piece = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], dict[int, int]]


def report(state: dict[str, Any], rank: int) -> dict[str, list[Piece]]:
    """Every tensor of a flattened state dict, as the pieces this rank holds (plain tensors of
    one shape and dtype summed in batches: 10,000 small tensors cost a few vector operations)."""
    found: dict[str, list[Piece]] = {}
    plain: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        # A DTensor on CPU is its pieces, not batched.
        if value.is_cpu and not isinstance(value, DTensor) and 0 < value.numel() <= _BATCH_ELEMENTS:
            plain.setdefault((tuple(value.shape), value.dtype), []).append((key, value))
            continue
        found[key] = [
            (rank, box.offsets, tuple(box.local.shape), box.global_shape, partials(box))
            for box in boxes(value)
        ]
    for (shape, _), group in plain.items():
        origin = (0,) * len(shape)
        for key, sums in _batched(shape, group):
            found[key] = [(rank, origin, shape, shape, sums)]
    return found


def _batched(
    shape: tuple[int, ...], group: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, dict[int, int]]]:
    """Block sums of whole tensors of one shape and dtype, a batch at a time: the samples of
    each (a strided view, gathered by one stack), weighted and summed per block as a matrix.
    The same values :func:`partials` gives each (zero padding adds 0)."""
    every, length = stride(shape), block_samples(shape)
    samples = -(-math.prod(shape) // every)
    blocks = -(-samples // length)
    weights = _weights()[:length].numpy()
    per_batch = max(1, _BATCH_ELEMENTS // (blocks * length))
    for at in range(0, len(group), per_batch):
        batch = group[at : at + per_batch]
        picked = torch.stack([tensor.detach().reshape(-1)[::every] for _, tensor in batch])
        # numpy's integer matrix product (it wraps, as documented: exact modulo 2**64) is
        # several times faster here than torch's elementwise product and sum.
        bits = _bits(picked).numpy().astype(numpy.int64)
        if blocks * length > samples:
            bits = numpy.pad(bits, ((0, 0), (0, blocks * length - samples)))
        sums = bits.reshape(len(batch), blocks, length) @ weights
        # The int64 sums, read as unsigned: the same bits, so the same value modulo 2**64.
        unsigned = sums.view(numpy.uint64).tolist()
        for (key, _), row_sums in zip(batch, unsigned, strict=True):
            yield key, dict(enumerate(row_sums))


def combine(reports: Iterable[dict[str, list[Piece]]]) -> dict[str, dict[int, int]]:
    """The fingerprints of every tensor: its pieces summed, each distinct piece once (a replica
    saved by several ranks, or a plain tensor every rank holds, counts once)."""
    # The common case, one whole piece: its sums are already < 2**64.
    return {
        key: found[0][4] if len(found) == 1 else _sum({p[1]: p[4] for p in found}.values())
        for key, found in _by_key(reports).items()
    }


def mismatches(
    saved: Mapping[str, Mapping[int, int]], reports: Iterable[dict[str, list[Piece]]]
) -> list[tuple[str, int, list[int]]]:
    """Where the live state differs from ``saved``: (key, block, ranks holding that block).

    A piece held by several ranks (a replica, a plain tensor) must be equal on each: a rank
    whose copy differs is named on its own. Keys ``saved`` has no fingerprints for are left
    out (the caller says so).
    """
    found: list[tuple[str, int, list[int]]] = []
    for key, pieces in sorted(_by_key(reports).items()):
        if key not in saved:
            continue
        if len(pieces) == 1 and _whole(pieces[0]) and pieces[0][4] == saved[key]:
            continue  # the common case, a plain tensor on one rank: one dict comparison
        expected = {int(b): int(v) for b, v in saved[key].items()}
        if odd := _odd_copies(pieces, expected):
            found += [(key, block, [rank]) for rank, block in odd]
            continue
        live = _sum({p[1]: p[4] for p in pieces}.values())
        for block in _differing(live, expected):
            found.append((key, block, sorted({p[0] for p in pieces if block in p[4]})))
    return found


def _odd_copies(pieces: list[Piece], expected: dict[int, int]) -> list[tuple[int, int]]:
    """(rank, first differing block) of copies that differ from the others holding the same
    piece (from ``expected`` when the piece is the whole tensor)."""
    odd: list[tuple[int, int]] = []
    groups: dict[tuple[int, ...], list[Piece]] = {}
    for piece in pieces:
        groups.setdefault(piece[1], []).append(piece)
    for copies in groups.values():  # a piece's most common copy, or the saved whole tensor
        common = Counter(tuple(sorted(p[4].items())) for p in copies).most_common(1)[0][0]
        reference = expected if _whole(copies[0]) else dict(common)
        odd += [(p[0], blocks[0]) for p in copies if (blocks := _differing(p[4], reference))]
    return odd


def _differing(sums: Mapping[int, int], reference: Mapping[int, int]) -> list[int]:
    """The blocks whose sums differ (an absent block sums to 0), ascending."""
    return sorted(b for b in set(sums) | set(reference) if sums.get(b, 0) != reference.get(b, 0))


def _whole(piece: Piece) -> bool:
    """The piece is the whole tensor (a plain tensor, or a fully replicated DTensor)."""
    return piece[2] == piece[3]


def _by_key(reports: Iterable[dict[str, list[Piece]]]) -> dict[str, list[Piece]]:
    merged: dict[str, list[Piece]] = {}
    for one in reports:
        for key, pieces in one.items():
            merged.setdefault(key, []).extend(pieces)
    return merged


def _sum(parts: Iterable[Mapping[int, int]]) -> dict[int, int]:
    total: dict[int, int] = {}
    for part in parts:
        for block, value in part.items():
            total[block] = (total.get(block, 0) + value) & _MASK
    return total


def audit_load(planner: SafeLoadPlanner, group: Any) -> None:
    """Check the tensors ``planner`` just loaded against the checkpoint's fingerprints.

    Call order: on every rank, right after the load, on the group the load used (``None``: a
    single process). Tensors the checkpoint has no fingerprints for are listed in
    ``report.unaudited`` and logged as a warning (on rank 0).

    Raises:
        ConfigError: the checkpoint was saved without fingerprints.
        RestoreMismatchError: the live state differs (on every rank, with the same list).
    """
    metadata = planner.metadata
    saved = (metadata.planner_data or {}).get(layout.AUDIT_KEY) if metadata else None
    name = planner.report.name or "the checkpoint"
    if not isinstance(saved, dict):
        raise ConfigError(
            f"{name} has no fingerprints to audit against (saved without dcp_safe's planner,"
            " or with record_audit=False); load it without audit=True"
        )
    rank = dist.get_rank(group) if group is not None else 0
    mine = report(planner.state_dict, rank)
    reports = [mine] if group is None else gather_objects(mine, group)
    found = mismatches(saved, reports)
    if found:
        raise RestoreMismatchError(name, found)
    loaded = {k for one in reports for k in one}
    planner.report.audited = tuple(sorted(loaded & saved.keys()))
    planner.report.unaudited = tuple(sorted(loaded - saved.keys()))
    if planner.report.unaudited and rank == 0:  # the same list on every rank: said once
        log.warning(
            "audit of %s: %d restored tensor(s) were not checked, the checkpoint has no"
            " fingerprints for them (a save records them for every tensor: these were cut"
            " from its metadata, or saved as something else): %s",
            shown(name),
            len(planner.report.unaudited),
            shown(", ".join(planner.report.unaudited), 400),
        )
