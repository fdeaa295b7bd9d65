"""``.metadata`` holds equal entry parts once: the same values as DCP's, pickled smaller."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dcp_safe
from dcp_safe import SafeStorageWriter


def _state() -> dict[str, object]:
    return {
        **{f"layer{i}.w": torch.randn(4, 3) for i in range(50)},
        **{f"layer{i}.b": torch.randn(3, dtype=torch.float64) for i in range(50)},
        "grad": torch.ones(2, requires_grad=True),
        "step": 7,
    }


def test_entries_equal_dcps_own_and_share_their_equal_parts(tmp_path: Path) -> None:
    state = _state()
    for step in ("a", "b"):  # planned, then from the cached plan
        dcp_safe.save(
            state, storage_writer=SafeStorageWriter(tmp_path), checkpoint_id=step, no_dist=True
        )
    theirs = dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "torch"), no_dist=True)
    for step in ("a", "b"):
        ours = pickle.loads((tmp_path / step / ".metadata").read_bytes())
        assert ours.state_dict_metadata == theirs.state_dict_metadata
        weights = [ours.state_dict_metadata[f"layer{i}.w"] for i in range(50)]
        assert all(w.properties is weights[0].properties for w in weights)
        assert all(w.size is weights[0].size for w in weights)
        assert all(w.chunks[0].sizes is weights[0].size for w in weights)
        grad = ours.state_dict_metadata["grad"].properties
        assert grad.requires_grad and grad is not weights[0].properties


def test_torchs_reader_loads_the_shared_entries(tmp_path: Path) -> None:
    state = _state()
    dcp_safe.save(
        state, storage_writer=SafeStorageWriter(tmp_path), checkpoint_id="a", no_dist=True
    )
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "a"), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value.detach()), key
    assert back["step"] == 7
