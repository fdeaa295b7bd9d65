"""Export of a checkpoint that two gloo ranks saved from DTensors: whole global tensors come out.

The ranks (spawned once by ``run_ranks``) save row-sharded (evenly and unevenly), column-sharded
and replicated DTensors, and return the full tensors gathered by DTensor itself; the export,
in this process with no process group, must reassemble exactly those from the chunks the two
ranks wrote to their own files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import gather_full
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

NAME = "step_0001"


def _save_dtensors(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(3)  # the same full tensors on every rank
    state = {
        "model": {
            "w_rows": distribute_tensor(torch.randn(9, 6, generator=gen), mesh, [Shard(0)]),
            "w_cols": distribute_tensor(torch.randn(6, 10, generator=gen), mesh, [Shard(1)]),
            "bias": distribute_tensor(torch.randn(6, generator=gen), mesh, [Replicate()]),
            "big": distribute_tensor(torch.randn(1024, 384, generator=gen), mesh, [Shard(0)]),
        },
        "meta": {"seed": 3},
    }
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(state, checkpoint_id=NAME, storage_writer=writer)
    return {f"model.{key}": value for key, value in gather_full(state["model"]).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("multirank") / "root"
    full = run_ranks(_save_dtensors, 2, args=(str(root),))
    assert all(set(result) == set(full[0]) for result in full)
    return root, full[0]


def test_the_checkpoint_really_holds_chunks_from_both_ranks(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, _ = saved
    reader = SafeStorageReader(root)
    reader.reset(NAME)
    entries = reader.read_metadata().state_dict_metadata
    for key in ("model.w_rows", "model.w_cols", "model.big"):
        meta = entries[key]
        assert isinstance(meta, TensorStorageMetadata) and len(meta.chunks) == 2, key
    assert len(list((root / NAME).glob("*.distcp"))) == 2


def test_safetensors_export_holds_the_global_tensors(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, full = saved
    result = dcp_safe.export(root, NAME, tmp_path / "out")
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(loaded) == sorted(full)
    for key, value in full.items():
        assert loaded[key].shape == value.shape and torch.equal(loaded[key], value), key
    assert dict(result.skipped) == {"meta.seed": "not a tensor (safetensors holds tensors only)"}


def test_sharded_safetensors_and_torch_exports_of_the_same_checkpoint(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, full = saved
    dcp_safe.export(root, NAME, tmp_path / "st", max_shard_bytes=1 << 10)
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / "st" / file_name))
    assert all(torch.equal(loaded[key], value) for key, value in full.items())

    dcp_safe.export(root, NAME, tmp_path / "pt", format="torch", dtype=torch.bfloat16)
    as_torch = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert as_torch["meta.seed"] == 3
    for key, value in full.items():
        assert torch.equal(as_torch[key], value.to(torch.bfloat16)), key
