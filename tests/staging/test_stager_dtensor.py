"""BudgetedStager with DTensor local shards, on a one-rank gloo process group."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_safe.staging import BudgetedStager, MemoryBudget


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}"
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_are_staged_and_rebuilt_with_their_spec(
    one_rank_group: None, tmp_path: Path
) -> None:
    mesh = init_device_mesh("cpu", (1,))
    state = {
        "sharded": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.arange(6.0), mesh, [Replicate()]),
        "plain": torch.ones(3),
    }
    expected = {
        k: v.full_tensor().clone() if isinstance(v, DTensor) else v.clone()
        for k, v in state.items()
    }
    with BudgetedStager(MemoryBudget(usable_bytes=1 << 24, reserve_bytes=0)) as stager:
        staged = stager.stage(state).result()
        for key in ("sharded", "replicated"):
            src, out = state[key], staged[key]
            assert isinstance(out, DTensor)
            assert out.device_mesh == src.device_mesh and out.placements == src.placements
            assert out.shape == src.shape and out.stride() == src.stride()
            assert out.to_local().data_ptr() != src.to_local().data_ptr()
            assert torch.equal(out.to_local(), src.to_local())
        del staged

        response = stager.async_save(state, storage_writer=FileSystemWriter(str(tmp_path)))
        response.staging_completion.result()
        for value in state.values():
            (value.to_local() if isinstance(value, DTensor) else value).add_(100)
        response.upload_completion.result()

    loaded = {
        "sharded": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.zeros(6), mesh, [Replicate()]),
        "plain": torch.zeros(3),
    }
    dcp.load(loaded, storage_reader=FileSystemReader(str(tmp_path)))
    for key, value in loaded.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(full, expected[key]), key
