"""Real multi-rank DCP saves and loads through SafeStorageWriter/SafeStorageReader on gloo.

Each test launches its ranks once with ``run_ranks`` (one process group per launch) and does
its multi-rank work there; rank functions return what they saw
and the assertions run here, in the parent, where pytest can explain a mismatch. One-rank
saves and loads run in the parent itself (no process group, so ``no_dist``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import assert_state_equal, blank_tree, rank_union
from torch.distributed.checkpoint import FileSystemReader, _async_process_executor
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CommitError,
    SafeStorageReader,
    SafeStorageWriter,
    StorageError,
    layout,
    list_checkpoints,
    verify_checkpoint,
)
from dcp_safe.manifest.schema import Manifest
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

W_SHAPE = (8, 4)
B_LEN = 5  # odd: Shard(0) over two ranks splits it 3 + 2


def _values(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rank_state(rank: int, seed: int = 0) -> dict[str, Any]:
    """What rank ``rank`` holds: its own tensors and object, plus state every rank replicates."""
    return {
        f"rank{rank}.weight": _values(seed + 10 + rank, 4, 3),
        f"rank{rank}.counts": torch.arange(6, dtype=torch.int64) * (rank + 1) + seed,
        f"rank{rank}.extra": {"owner": rank, "history": [seed, rank]},
        "shared.bias": _values(seed + 99, 5),
        "shared.config": {"epochs": 3, "seed": seed},
    }


def _load(root: Path, name: str, like: dict[str, Any]) -> dict[str, Any]:
    """Load ``name`` in this (undistributed) process into a blank copy of ``like``."""
    target = blank_tree(like)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root))
    return target


def _manifest(root: Path, name: str) -> Manifest:
    path = root / name / layout.MANIFEST
    return Manifest.from_json(path.read_bytes(), str(path))


def _writer_rank(file_name: str) -> int:
    """The rank that wrote a shard file (``__<rank>_<n>.distcp``)."""
    return int(file_name.split("_")[2])


# --------------------------------------------------------------- rank functions (module level)


def _save_rank_state(rank: int, world_size: int, root: str) -> None:
    dcp_safe.save(
        _rank_state(rank), checkpoint_id="two_ranks", storage_writer=SafeStorageWriter(root)
    )


def _load_full_state(rank: int, world_size: int, root: str, like: dict[str, Any]) -> Any:
    target = blank_tree(like)
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=SafeStorageReader(root))
    return target


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", [0, 1])


def _save_and_reload_sharded(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    mesh = _mesh()
    state = {
        "w": distribute_tensor(_values(1, *W_SHAPE), mesh, [Shard(0)]),
        "b": distribute_tensor(_values(2, B_LEN), mesh, [Shard(0)]),
    }
    dcp_safe.save(state, checkpoint_id="sharded", storage_writer=SafeStorageWriter(root))

    same = {
        "w": distribute_tensor(torch.zeros(W_SHAPE), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.zeros(B_LEN), mesh, [Shard(0)]),
    }
    dcp_safe.load(same, checkpoint_id="sharded", storage_reader=SafeStorageReader(root))
    resharded = {"w": distribute_tensor(torch.zeros(W_SHAPE), mesh, [Shard(1)])}
    dcp_safe.load(resharded, checkpoint_id="sharded", storage_reader=SafeStorageReader(root))
    assert all(isinstance(t, DTensor) for t in [*same.values(), *resharded.values()])
    return {
        "w_local": same["w"].to_local(),
        "b_local": same["b"].to_local(),
        "w_full": same["w"].full_tensor(),
        "w_shard1_local": resharded["w"].to_local(),
    }


def _fail_second_save_on_rank_1(rank: int, world_size: int, root: str) -> dict[str, Any]:
    dcp_safe.save(_rank_state(rank), checkpoint_id="good", storage_writer=SafeStorageWriter(root))

    writer = SafeStorageWriter(root)
    if rank == 1:
        write_data = writer.write_data

        def write_then_fail(plan: Any, planner: Any) -> Any:
            write_data(plan, planner)  # every byte and the rank manifest reach storage...
            raise OSError(errno.EIO, "injected I/O error on rank 1")  # ...and then it fails

        writer.write_data = write_then_fail  # type: ignore[method-assign]
    try:
        dcp_safe.save(_rank_state(rank, seed=1), checkpoint_id="bad", storage_writer=writer)
    except CommitError as exc:
        seen = {"error": type(exc).__name__, "failures": exc.failures}
    else:
        seen = {"error": None, "failures": {}}
    seen["listed_after_failure"] = [info.name for info in list_checkpoints(root)]
    target = blank_tree(rank_union(_rank_state, world_size))
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=SafeStorageReader(root))
    seen["latest_after_failure"] = target
    return seen


def _disk_full_on_rank_1(rank: int, world_size: int, root: str) -> dict[str, Any]:
    if rank == 1:

        def no_space(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.fsync = no_space  # every durable write on rank 1 fails, as on a full disk
    try:
        dcp_safe.save(
            _rank_state(rank), checkpoint_id="disk_full", storage_writer=SafeStorageWriter(root)
        )
    except StorageError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "operation": exc.operation}
    return {"error": None}


def _load_with_rank_1_shard_flipped(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = _mesh()
    state = {"w": distribute_tensor(_values(1, *W_SHAPE), mesh, [Shard(0)])}
    dcp_safe.save(state, checkpoint_id="flipped", storage_writer=SafeStorageWriter(root))
    if rank == 1:
        shard = Path(root, "flipped", layout.shard_file_name(1, 0))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    target = {"w": distribute_tensor(torch.zeros(W_SHAPE), mesh, [Shard(0)])}
    try:
        dcp_safe.load(target, checkpoint_id="flipped", storage_reader=SafeStorageReader(root))
    except CheckpointCorruptError as exc:
        return {"error": type(exc).__name__, "path": exc.path, "item": exc.item}
    return {"error": None}


class _FailsOnRank1(SafeStorageWriter):
    """Module level, so that it pickles into DCP's checkpoint process."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if torch.distributed.get_rank() == 1:
            raise OSError(errno.EIO, f"injected I/O error in pid {os.getpid()}")
        return super().write_data(plan, planner)


def _async_save_both_ways(rank: int, world_size: int, root: str) -> dict[str, Any]:
    seen: dict[str, Any] = {"rank_pid": os.getpid()}
    for mode in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        future = dcp_safe.async_save(
            _rank_state(rank, seed=7),
            checkpoint_id=f"async_{mode.value}",
            storage_writer=SafeStorageWriter(root),
            async_checkpointer_type=mode,
        )
        seen[mode.value] = future.result().storage_meta.checkpoint_id
    # DCP keeps one checkpoint process per rank for the life of the rank.
    seen["checkpoint_pid"] = _async_process_executor._CHECKPOINT_PROCESS._save_process.pid
    failing = dcp_safe.async_save(
        _rank_state(rank, seed=8),
        checkpoint_id="async_failed",
        storage_writer=_FailsOnRank1(root),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    try:
        failing.result()
    except CommitError as exc:
        seen["failed"] = (type(exc).__name__, exc.failures)
    return seen


# --------------------------------------------------------------- tests


def test_two_rank_save_with_own_and_replicated_state_loads_on_one_rank(tmp_path: Path) -> None:
    run_ranks(_save_rank_state, 2, args=(str(tmp_path),))

    expected = rank_union(_rank_state, 2)
    assert_state_equal(_load(tmp_path, "two_ranks", expected), expected)
    [info] = list_checkpoints(tmp_path)
    assert (info.name, info.world_size) == ("two_ranks", 2)
    assert verify_checkpoint(tmp_path, "two_ranks").items_checked == len(
        _manifest(tmp_path, "two_ranks").items
    )
    # Each rank wrote its own tensors; the replicated one was written once.
    items = _manifest(tmp_path, "two_ranks").items
    by_fqn: dict[str, list[int]] = {}
    for item in items:
        by_fqn.setdefault(item.fqn, []).append(_writer_rank(item.file))
    assert by_fqn["rank0.weight"] == [0]
    assert by_fqn["rank1.weight"] == [1]
    assert len(by_fqn["shared.bias"]) == 1
    assert sorted(os.listdir(tmp_path / "two_ranks" / layout.RANKS_DIR)) == [
        "rank_00000.json",
        "rank_00001.json",
    ]
    # torch's own reader sees the same checkpoint.
    plain = blank_tree(expected)
    dcp.load(plain, storage_reader=FileSystemReader(str(tmp_path / "two_ranks")), no_dist=True)
    assert_state_equal(plain, expected)


def test_one_rank_save_loads_on_two_ranks(tmp_path: Path) -> None:
    expected = _rank_state(0, seed=3)
    dcp_safe.save(expected, checkpoint_id="one_rank", storage_writer=SafeStorageWriter(tmp_path))

    loaded = run_ranks(_load_full_state, 2, args=(str(tmp_path), expected))

    for state in loaded:
        assert_state_equal(state, expected)


def test_sharded_dtensors_load_whole_on_one_rank_and_back_as_shards_on_two(
    tmp_path: Path,
) -> None:
    full_w, full_b = _values(1, *W_SHAPE), _values(2, B_LEN)

    per_rank = run_ranks(_save_and_reload_sharded, 2, args=(str(tmp_path),))

    for rank, seen in enumerate(per_rank):
        assert torch.equal(seen["w_local"], full_w.chunk(2, dim=0)[rank])
        assert torch.equal(seen["b_local"], full_b.chunk(2, dim=0)[rank])
        assert torch.equal(seen["w_full"], full_w)
        assert torch.equal(seen["w_shard1_local"], full_w.chunk(2, dim=1)[rank])
    # Each rank wrote only its shard of each tensor.
    offsets = {
        (i.fqn, i.offset): _writer_rank(i.file) for i in _manifest(tmp_path, "sharded").items
    }
    assert offsets == {("w", (0, 0)): 0, ("w", (4, 0)): 1, ("b", (0,)): 0, ("b", (3,)): 1}
    # One undistributed process loads the whole tensors.
    whole = {"w": torch.zeros(W_SHAPE), "b": torch.zeros(B_LEN)}
    dcp_safe.load(whole, checkpoint_id="sharded", storage_reader=SafeStorageReader(tmp_path))
    assert torch.equal(whole["w"], full_w)
    assert torch.equal(whole["b"], full_b)


def test_a_rank_failing_in_write_data_fails_the_save_everywhere_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    per_rank = run_ranks(_fail_second_save_on_rank_1, 2, args=(str(tmp_path),))

    good = rank_union(_rank_state, 2)
    for seen in per_rank:
        assert seen["error"] == "CommitError"
        assert list(seen["failures"]) == [1]
        assert "injected I/O error on rank 1" in seen["failures"][1]
        assert seen["listed_after_failure"] == ["good"]
        assert_state_equal(seen["latest_after_failure"], good)
    assert [info.name for info in list_checkpoints(tmp_path)] == ["good"]
    assert not (tmp_path / "bad").exists()
    with pytest.raises(CheckpointNotFoundError):
        _load(tmp_path, "bad", good)
    assert_state_equal(_load(tmp_path, "good", good), good)
    verify_checkpoint(tmp_path, "good")


def test_a_storage_error_on_one_rank_reaches_every_rank_intact(tmp_path: Path) -> None:
    # DCP carries a rank's exception to rank 0 (gather_object) and from there to every rank
    # (broadcast_object) by pickling it, so dcp_safe's errors must survive a pickle round trip.
    per_rank = run_ranks(_disk_full_on_rank_1, 2, args=(str(tmp_path),), timeout_s=90)

    for seen in per_rank:
        assert seen["error"] == "StorageError"
        assert "No space left on device" in seen["message"]
        assert str(tmp_path) in seen["message"]
    assert list_checkpoints(tmp_path) == []


def test_corruption_found_by_one_rank_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    per_rank = run_ranks(_load_with_rank_1_shard_flipped, 2, args=(str(tmp_path),), timeout_s=90)

    # Only rank 1 reads the damaged shard (each rank loads its own rows), yet both learn of it.
    for seen in per_rank:
        assert seen["error"] == "CheckpointCorruptError"
        assert seen["path"].endswith(layout.shard_file_name(1, 0))
        assert seen["item"] == "w@[4, 0]"


def test_async_save_in_a_thread_and_in_a_process_commits_on_two_ranks(tmp_path: Path) -> None:
    per_rank = run_ranks(_async_save_both_ways, 2, args=(str(tmp_path),))

    expected = rank_union(_rank_state, 2, seed=7)
    for name in ("async_thread", "async_process"):
        assert [seen[name.removeprefix("async_")] for seen in per_rank] == [name, name]
        assert verify_checkpoint(tmp_path, name).name == name
        assert _manifest(tmp_path, name).world_size == 2
        assert_state_equal(_load(tmp_path, name, expected), expected)
    # PROCESS mode really saved from another process, which did not outlive its rank.
    for seen in per_rank:
        assert seen["checkpoint_pid"] != seen["rank_pid"]
        assert not psutil.pid_exists(seen["checkpoint_pid"]) or (
            psutil.Process(seen["checkpoint_pid"]).status() == psutil.STATUS_ZOMBIE
        )
    # A failure inside the checkpoint process reaches both ranks' futures as a CommitError.
    for seen in per_rank:
        error, failures = seen["failed"]
        assert error == "CommitError"
        assert list(failures) == [1]
        # ...raised in rank 1's checkpoint process, not in the rank itself.
        assert f"injected I/O error in pid {per_rank[1]['checkpoint_pid']}" in failures[1]
    assert "async_failed" not in [info.name for info in list_checkpoints(tmp_path)]
