"""Resharded loads read only the blocks of each stored chunk they need, each block verified.

A 32 MiB tensor is saved as a DTensor ``Shard(0)`` over 2 gloo ranks (two 16 MiB chunks of
four 4 MiB blocks), then loaded over 4 ranks (each needs half of one chunk) and over 1. Checked:
exact values; each of the 4 ranks reads 8 MiB of stored bytes, against 16 MiB from a checkpoint
written without block digests (as before them) and from a signed one; a flipped byte in a block
a rank needs fails that rank's load with ``CheckpointCorruptError``, while a rank that does not
need that block loads exactly (its bytes are never used), and full verification still fails.
An FSDP2 model (a 32 MiB weight of 8190 rows, uneven over 4 ranks) and its Adam moments saved
on 2 ranks load exactly on 4, each rank reading its rows plus block rounding. In one process,
with the read item DCP plans for such a rank: a damaged block is read again from the other tier.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import assert_state_equal, gather_full, resign_manifest
from support.training import app_state
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    SafeStorageReader,
    SafeStorageWriter,
    layout,
    verify_checkpoint,
)
from dcp_safe.adapters.options import WriterOptions
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.blocks import BLOCK_BYTES, BlockDigests, BlockHasher
from dcp_safe.manifest.schema import Manifest
from dcp_safe.reading.tensors import plan_range
from dcp_safe.testing.multiproc import run_ranks

MIB = 1 << 20
ROWS, COLS = 8192, 1024  # float32: 32 MiB; a row is 4 KiB
KEY = b"k" * 32


def _full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))


def _sharded(world_size: int, tensor: torch.Tensor) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return {"w": distribute_tensor(tensor, mesh, [Shard(0)])}


def _blocks(*, length: int = 64 * MIB, block_bytes: int = BLOCK_BYTES) -> BlockDigests:
    count = -(-length // block_bytes)
    return BlockDigests(at=0, length=length, block_bytes=block_bytes, digests=("ab",) * count)


# --------------------------------------------------------------- which blocks a region needs


def test_a_slice_along_dim_0_is_one_run_read_from_the_blocks_covering_it() -> None:
    # [16384, 1024] float32 = 64 MiB = 16 blocks; rows 4096..6143 are bytes [16, 24) MiB.
    plan = plan_range(_blocks(), (16384, 1024), 4, (4096, 0), (2048, 1024))
    assert plan is not None
    assert plan.runs == ((16 * MIB, 8 * MIB),)
    assert plan.spans == ((4, 6),) and plan.read_bytes == 8 * MIB
    # Not block-aligned: rounded out to whole blocks.
    plan = plan_range(_blocks(), (16384, 1024), 4, (100, 0), (2048, 1024))
    assert plan is not None and plan.spans == ((0, 3),) and plan.read_bytes == 12 * MIB
    # Most blocks but not all: still fewer bytes, through one bounded buffer.
    plan = plan_range(_blocks(), (16384, 1024), 4, (0, 0), (14000, 1024))
    assert plan is not None and plan.spans == ((0, 14),) and plan.buffer_bytes == 16 * MIB


def test_a_sub_block_of_rows_is_a_few_runs_and_only_their_blocks_are_read() -> None:
    # [4, 4096, 1024] float32: each of the 4 outer slices is 16 MiB (4 blocks); rows 0..1023
    # of the first two slices are 2 runs of 4 MiB, in blocks 0 and 4.
    plan = plan_range(_blocks(), (4, 4096, 1024), 4, (0, 0, 0), (2, 1024, 1024))
    assert plan is not None
    assert plan.runs == ((0, 4 * MIB), (16 * MIB, 4 * MIB))
    assert plan.spans == ((0, 1), (4, 5)) and plan.read_bytes == 8 * MIB


@pytest.mark.parametrize(
    ("offsets", "lengths"),
    [
        ((0, 0), (16384, 1024)),  # the whole chunk: read whole, straight into its target
        ((0, 0), (16384, 512)),  # half of every row: 16,384 runs
        ((1, 0), (16383, 1024)),  # all but one row: every block
    ],
)
def test_regions_better_read_whole_are_left_to_the_whole_item_read(
    offsets: tuple[int, int], lengths: tuple[int, int]
) -> None:
    assert plan_range(_blocks(), (16384, 1024), 4, offsets, lengths) is None


# --------------------------------------------------------------- which items get digests


def _manifest(root: Path, name: str) -> Manifest:
    return Manifest.from_json((root / name / layout.MANIFEST).read_bytes(), name)


def test_only_large_uncompressed_tensors_get_block_digests(tmp_path: Path) -> None:
    state = {
        "large": torch.zeros(2 * BLOCK_BYTES // 4),  # 8 MiB: 2 blocks
        "small": torch.zeros(2 * BLOCK_BYTES // 4 - 1),
        "object": ["step", 3],
    }
    dcp_safe.save(state, checkpoint_id="plain", storage_writer=SafeStorageWriter(tmp_path))
    blocks = {item.fqn: item.blocks for item in _manifest(tmp_path, "plain").items}
    large = blocks.pop("large")
    assert large is not None and large.length == 2 * BLOCK_BYTES and len(large.digests) == 2
    assert blocks == {"small": None, "object": None}
    zstd = SafeStorageWriter(tmp_path, options=WriterOptions(compression="zstd"))
    dcp_safe.save(state, checkpoint_id="zstd", storage_writer=zstd)
    assert all(item.blocks is None for item in _manifest(tmp_path, "zstd").items)
    with pytest.raises(ConfigError, match="block_digests"):
        WriterOptions(block_digests="no")  # type: ignore[arg-type]


# --------------------------------------------------------------- one process, DCP's read items


def _read_rows(reader: SafeStorageReader, name: str, first: int, count: int) -> torch.Tensor:
    """Rows ``first`` to ``first + count`` of the stored ``w``, through DCP's own planner and
    the read item DCP plans for a rank that owns those rows (as in a resharded load)."""
    reader.reset(name)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    target = torch.zeros(count, COLS)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": target}, metadata, True)
    request = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", torch.Size([0, 0])),
        storage_offsets=torch.Size([first, 0]),
        lengths=torch.Size([count, COLS]),
    )
    reader.read_data(LoadPlan([request]), planner).wait()
    return target


def test_a_damaged_block_is_read_again_from_the_other_tier_and_old_checkpoints_read_whole(
    tmp_path: Path,
) -> None:
    full = _full()  # one item of 32 MiB: 8 blocks
    primary, replica = tmp_path / "primary", tmp_path / "replica"
    dcp_safe.save({"w": full}, checkpoint_id="s", storage_writer=SafeStorageWriter(primary))
    old = SafeStorageWriter(primary, options=WriterOptions(block_digests=False))
    dcp_safe.save({"w": full}, checkpoint_id="old", storage_writer=old)
    shutil.copytree(primary / "s", replica / "s")

    reader = SafeStorageReader(primary)
    assert torch.equal(_read_rows(reader, "s", 2048, 2048), full[2048:4096])
    assert reader.bytes_read == 8 * MIB  # blocks 2 and 3
    old_item = next(i for i in _manifest(primary, "old").items)
    assert torch.equal(_read_rows(reader, "old", 2048, 2048), full[2048:4096])
    assert reader.bytes_read == old_item.length  # no block digests: the whole item, as before

    _flip_data_byte(primary, "s", (0, 0), 2 * BLOCK_BYTES + 7)
    with pytest.raises(CheckpointCorruptError, match="block 2 of the tensor data"):
        _read_rows(SafeStorageReader(primary), "s", 2048, 2048)
    assert torch.equal(_read_rows(SafeStorageReader(primary), "s", 4096, 10), full[4096:4106])
    with_replica = SafeStorageReader(primary, fallback=replica)
    assert torch.equal(_read_rows(with_replica, "s", 2048, 2048), full[2048:4096])
    assert with_replica.items_from_fallback == 1


def _move_blocks(root: Path, name: str, by: int) -> None:
    """Move ``w``'s block digests ``by`` bytes into the item and hash the blocks there again,
    as a root writer can: the item's bytes and checksum stay as they are (issue 43, 10)."""
    folder = root / name
    manifest = _manifest(root, name)
    record = next(i for i in manifest.items if i.fqn == "w")
    assert record.blocks is not None
    data = (folder / record.file).read_bytes()[record.start : record.start + record.length]
    hasher = BlockHasher(
        record.checksum.partition(":")[0],
        item_start=0,
        at=record.blocks.at + by,
        length=record.blocks.length,
        block_bytes=record.blocks.block_bytes,
    )
    hasher.update(0, memoryview(data))
    moved = hasher.result().to_dict()

    def edit(raw: dict[str, Any]) -> None:
        (item,) = (i for i in raw["items"] if i["fqn"] == "w")
        item["blocks"] = moved

    resign_manifest(root, name, edit)


def test_block_digests_moved_off_the_tensor_data_are_refused_by_a_ranged_read(
    tmp_path: Path,
) -> None:
    full = _full()
    dcp_safe.save({"w": full}, checkpoint_id="s", storage_writer=SafeStorageWriter(tmp_path))
    _move_blocks(tmp_path, "s", 64 * 4)  # 64 float32 elements into the data
    with pytest.raises(CheckpointCorruptError, match="block digests do not lie over the tensor"):
        _read_rows(SafeStorageReader(tmp_path), "s", 2048, 2048)
    # A whole load refuses too: every load of this manifest agrees.
    whole = {"w": torch.zeros_like(full)}
    with pytest.raises(CheckpointCorruptError, match="block digests do not lie"):
        dcp_safe.load(whole, checkpoint_id="s", storage_reader=SafeStorageReader(tmp_path))


# --------------------------------------------------------------- rank functions (module level)


def _save(rank: int, world_size: int, root: str) -> None:
    state = _sharded(world_size, _full())
    dcp_safe.save(state, checkpoint_id="blocks", storage_writer=SafeStorageWriter(root))
    plain = SafeStorageWriter(root, options=WriterOptions(block_digests=False))
    dcp_safe.save(state, checkpoint_id="plain", storage_writer=plain)
    signed = SafeStorageWriter(root, options=WriterOptions(signing_key=KEY))
    dcp_safe.save(state, checkpoint_id="signed", storage_writer=signed)


def _load_each(rank: int, world_size: int, root: str) -> dict[str, Any]:
    expected = _sharded(world_size, _full())["w"].to_local()
    seen: dict[str, Any] = {}
    for name in ("blocks", "plain", "signed"):
        target = _sharded(world_size, torch.zeros(ROWS, COLS))
        key = KEY if name == "signed" else None
        reader = SafeStorageReader(root, signing_key=key)
        dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
        seen[name] = (torch.equal(target["w"].to_local(), expected), reader.bytes_read)
    return seen


def _load_alone(rank: int, world_size: int, root: str) -> str:
    """Each rank loads on its own (no collectives), so one rank's failure is its own."""
    target = _sharded(world_size, torch.zeros(ROWS, COLS))
    reader = SafeStorageReader(root)
    try:
        dcp.load(target, checkpoint_id="blocks", storage_reader=reader, no_dist=True)
    except CheckpointException as exc:  # DCP's wrapper of what read_data raised (BaseException)
        failures = [failure for failure, _ in exc.failures.values()]
        return "; ".join(f"{type(failure).__name__}: {failure}" for failure in failures)
    expected = _full().chunk(world_size)[rank]  # no collective: rank 1 failed above
    return "exact" if torch.equal(target["w"].to_local(), expected) else "wrong values"


FSDP_OUT, FSDP_IN = 8190, 1024  # a 32 MiB weight; 8190 rows: uneven over 4 ranks (FSDP2 pads)


def _fsdp_model(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(FSDP_IN, FSDP_OUT, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _fsdp_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = _fsdp_model(world_size, seed=0)
    x = torch.randn(4, FSDP_IN, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    optimizer.step()
    state = app_state(model, optimizer)
    dcp_safe.save(state, checkpoint_id="fsdp", storage_writer=SafeStorageWriter(root))
    return gather_full(state)


def _fsdp_load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = _fsdp_model(world_size, seed=5)  # other values: the load replaces them
    target = app_state(model, optimizer)
    reader = SafeStorageReader(root)
    dcp_safe.load(target, checkpoint_id="fsdp", storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    rows = model.weight.to_local().shape[0]
    return {
        "state": gather_full(app_state(model, optimizer)),
        "read": reader.bytes_read,
        "rows": rows,
    }


def _flip_data_byte(root: Path, name: str, offset: tuple[int, int], data_at: int) -> None:
    """Flip the byte ``data_at`` bytes into the tensor data of the chunk at ``offset``."""
    manifest = Manifest.from_json((root / name / layout.MANIFEST).read_bytes(), name)
    record = next(i for i in manifest.items if i.fqn == "w" and i.offset == offset)
    assert record.blocks is not None
    with open(root / name / record.file, "r+b") as f:
        f.seek(record.start + record.blocks.at + data_at)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_resharded_load_reads_only_the_blocks_each_rank_needs(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(_save, 2, args=(root,))
    manifest = Manifest.from_json((tmp_path / "signed" / layout.MANIFEST).read_bytes(), "m")
    chunk = ROWS * COLS * 4 // 2
    assert all(
        item.blocks is not None and item.blocks.length == chunk and len(item.blocks.digests) == 4
        for item in manifest.items
    )
    assert all(len(item.blocks.digests[0]) == 64 for item in manifest.items if item.blocks)
    plain = Manifest.from_json((tmp_path / "plain" / layout.MANIFEST).read_bytes(), "m")
    assert all(item.blocks is None for item in plain.items)

    four = run_ranks(_load_each, 4, args=(root,))

    for rank, seen in enumerate(four):
        assert seen["blocks"] == (True, chunk // 2), rank  # 8 MiB: 2 of the chunk's 4 blocks
        assert seen["signed"] == (True, chunk // 2), rank  # blake3 block digests, signed
        item_bytes = next(i.length for i in plain.items)
        assert seen["plain"] == (True, item_bytes), rank  # without digests: the whole chunk
    # One undistributed process loads the whole tensor: every block, whole items.
    whole = {"w": torch.zeros(ROWS, COLS)}
    reader = SafeStorageReader(root)
    dcp_safe.load(whole, checkpoint_id="blocks", storage_reader=reader)
    assert torch.equal(whole["w"], _full())
    assert reader.bytes_read == sum(item.length for item in manifest.items)

    # Rank 0 of 4 needs blocks 0-1 of the first chunk, rank 1 blocks 2-3: flip a byte in 3.
    _flip_data_byte(tmp_path, "blocks", (0, 0), 3 * BLOCK_BYTES + 12345)

    alone = run_ranks(_load_alone, 4, args=(root,))

    assert alone[0] == alone[2] == alone[3] == "exact"
    assert alone[1].startswith("CheckpointCorruptError")
    assert "block 3 of the tensor data" in alone[1]
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        verify_checkpoint(tmp_path, "blocks")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fsdp2_model_and_adam_state_saved_on_two_ranks_load_on_four_from_their_blocks(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    saved = run_ranks(_fsdp_save, 2, args=(root,))[0]

    four = run_ranks(_fsdp_load, 4, args=(root,))

    for rank, seen in enumerate(four):
        assert_state_equal(seen["state"], saved, f"2->4 rank {rank}")
    assert [seen["rows"] for seen in four] == [2048, 2048, 2048, 2046]
    # The weight and Adam's two moments: 2 stored chunks of 4095 rows (4 blocks) each. A rank
    # reads its rows plus at most a block of rounding at each end of each chunk it overlaps
    # (rank 1 overlaps both); read whole, ranks 0, 2 and 3 would read a chunk of each, rank 1
    # both chunks: 3 x 80 MiB in all.
    row = FSDP_IN * 4
    for rank, seen in enumerate(four):
        chunks = 2 if rank == 1 else 1
        assert seen["read"] <= 3 * (seen["rows"] * row + chunks * 2 * BLOCK_BYTES) + 65536, rank
    assert sum(seen["read"] for seen in four) <= 0.55 * 3 * 80 * MIB
