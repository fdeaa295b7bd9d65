"""N ranks' outputs of a save, laid down without a process group, and rank 0's publish.

What ``SafeStorageWriter.write_data`` leaves on storage for each rank (its shard file holding
its items as DCP's own ``torch.save`` bytes, and its rank manifest, written with the library's
own types under the work folder the publish strategy names, behind the strategy's own claim),
together with DCP's global ``Metadata`` and the per-rank ``WriteResult`` lists DCP hands to
``finish``. Each rank holds ``items`` FSDP-style row shards: item ``k`` of rank ``r`` is rows
``[r*R, (r+1)*R)`` of ``layers.k.weight``, so ``.metadata`` and ``manifest.json`` grow with N as
a real save's do. Used by ``benchmarks/bench_coordinator.py`` (coordinator time vs world size)
and by the committer's tests.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from dcp_safe import layout
from dcp_safe.adapters.options import WriterOptions
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.committer import DEFAULT_COMMIT_WORKERS, Committer
from dcp_safe.commit.results import attach_report, report_for
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.manifest.checksum import digest_bytes
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest, RankManifest

__all__ = [
    "COLUMNS",
    "ITEMS_PER_RANK",
    "ROWS_PER_RANK",
    "SimulatedSave",
    "publish",
    "simulate",
]

ITEMS_PER_RANK = 4
ROWS_PER_RANK = 8
COLUMNS = 32  # float32: 1 KiB of tensor bytes per item
SETUP_WORKERS = 32


@dataclass
class SimulatedSave:
    """What DCP hands ``SafeStorageWriter.finish`` on rank 0, with the ranks' files in place."""

    name: str
    save_id: str
    work_dir: str
    world_size: int
    metadata: Metadata
    results: list[list[WriteResult]]


def _tensor_bytes(rank: int, item: int) -> bytes:
    """DCP's own item format for a tensor (what ``FileSystemWriter`` writes): ``torch.save``."""
    tensor = torch.full((ROWS_PER_RANK, COLUMNS), float(rank * 1000 + item))
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _global_metadata(world_size: int, items: int) -> Metadata:
    rows = world_size * ROWS_PER_RANK
    return Metadata(
        state_dict_metadata={
            f"layers.{k}.weight": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([rows, COLUMNS]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size([r * ROWS_PER_RANK, 0]),
                        sizes=torch.Size([ROWS_PER_RANK, COLUMNS]),
                    )
                    for r in range(world_size)
                ],
            )
            for k in range(items)
        }
    )


def _write_rank(
    backend: Backend, name: str, save_id: str, work_dir: str, rank: int, items: int
) -> list[WriteResult]:
    """One rank's ``write_data``: its shard file, then its rank manifest."""
    options = WriterOptions()
    shard = layout.shard_file_name(rank, 0)
    payload = bytearray()
    records: list[ItemRecord] = []
    results: list[WriteResult] = []
    for k in range(items):
        data = _tensor_bytes(rank, k)
        offset = (rank * ROWS_PER_RANK, 0)
        record = ItemRecord(
            fqn=f"layers.{k}.weight",
            offset=offset,
            file=shard,
            start=len(payload),
            length=len(data),
            checksum=digest_bytes(data, options.checksum),
        )
        payload += data
        records.append(record)
        index = MetadataIndex(f"layers.{k}.weight", torch.Size(offset), rank)
        results.append(WriteResult(index=index, size_in_bytes=len(data), storage_data=record))
    backend.write_bytes(f"{work_dir}/{shard}", bytes(payload))
    manifest = RankManifest(
        name=name,
        save_id=save_id,
        rank=rank,
        checksum_algorithm=options.checksum.value,
        files=(FileRecord(path=shard, size=len(payload)),),
        items=tuple(records),
    )
    written = manifest.to_json()
    backend.write_bytes(f"{work_dir}/{layout.rank_manifest_name(rank)}", written)
    return attach_report(results, report_for(manifest, written, options.checksum))


def simulate(
    backend: Backend, name: str, world_size: int, *, items: int = ITEMS_PER_RANK
) -> SimulatedSave:
    """Lay down ``world_size`` ranks' outputs of a save of ``name``, as the writer does."""
    publication = strategy_for(backend).publication(backend, name, layout.new_save_id())
    publication.claim()  # the writing lease, where the root needs one
    save_id, work_dir = publication.save_id, publication.work_dir
    backend.makedirs(f"{work_dir}/{layout.RANKS_DIR}")
    with ThreadPoolExecutor(max_workers=SETUP_WORKERS) as pool:
        futures = [
            pool.submit(_write_rank, backend, name, save_id, work_dir, rank, items)
            for rank in range(world_size)
        ]
        results = [f.result() for f in futures]
    metadata = _global_metadata(world_size, items)
    return SimulatedSave(name, save_id, work_dir, world_size, metadata, results)


def publish(
    backend: Backend, save: SimulatedSave, *, workers: int = DEFAULT_COMMIT_WORKERS
) -> Manifest:
    """Rank 0's ``finish``: verify every rank's output and publish the checkpoint."""
    return Committer(backend, WriterOptions(), workers=workers).publish(
        strategy_for(backend).publication(backend, save.name, save.save_id),
        world_size=save.world_size,
        step=None,
        metadata=save.metadata,
        results=save.results,
    )
