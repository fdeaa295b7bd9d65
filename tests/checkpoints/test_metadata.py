"""``read_dcp_metadata`` decodes a manifest's plain DCP metadata once per manifest, and hands
every caller a copy it may change.

A restore of the same checkpoint meets the same ``Manifest`` object again (``open_committed``
parses given bytes once); decoding its metadata is ~0.3 s of Python at 10,000 tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_state
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.checkpoints import metadata as metadata_module
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.metadata import read_dcp_metadata


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths whose plain metadata is decoded from now on."""
    seen: list[str] = []
    decode = metadata_module.decode_dcp_metadata

    def counting(plain: Any, manifest: Any, path: str) -> Any:
        seen.append(path)
        return decode(plain, manifest, path)

    monkeypatch.setattr(metadata_module, "decode_dcp_metadata", counting)
    return seen


@pytest.fixture
def root(tmp_path: Path) -> Path:
    writer = SafeStorageWriter(tmp_path, options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(make_state(1), checkpoint_id="step_0001", storage_writer=writer)
    return tmp_path


def test_one_manifest_is_decoded_once_and_each_caller_gets_its_own_copy(
    root: Path, decodes: list[str]
) -> None:
    backend = LocalBackend(str(root))
    manifest = open_committed(backend, "step_0001").manifest
    first = read_dcp_metadata(backend, "step_0001", manifest)
    first.storage_meta = StorageMeta(checkpoint_id="changed by a caller")
    first.state_dict_metadata.clear()
    second = read_dcp_metadata(backend, "step_0001", open_committed(backend, "step_0001").manifest)
    assert len(decodes) == 1
    assert second is not first
    assert second.state_dict_metadata  # the first caller's changes are its own
    assert second.storage_meta is None or second.storage_meta.checkpoint_id != "changed by a caller"


def test_repeated_restores_load_the_same_values(root: Path, decodes: list[str]) -> None:
    expected = make_state(1)
    for _ in range(3):
        target = make_state(2)
        dcp_safe.load(target, checkpoint_id="step_0001", storage_reader=SafeStorageReader(root))
        assert torch.equal(target["f32"], expected["f32"]) and target["extra"] == expected["extra"]
    assert len(decodes) == 1


def test_another_manifest_is_decoded_anew(root: Path, decodes: list[str]) -> None:
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False), step=2)
    dcp_safe.save(make_state(2), checkpoint_id="step_0002", storage_writer=writer)
    backend = LocalBackend(str(root))
    for name in ("step_0001", "step_0002"):
        read_dcp_metadata(backend, name, open_committed(backend, name).manifest)
    assert len(decodes) == 2


def test_a_callers_change_to_an_entry_never_reaches_a_later_load(
    root: Path, decodes: list[str]
) -> None:
    """Every entry the decoder built is the caller's own: its size, properties, chunks, the
    storage records and the audit's fingerprints (was: shared with the cache)."""
    backend = LocalBackend(str(root))
    manifest = open_committed(backend, "step_0001").manifest
    first = read_dcp_metadata(backend, "step_0001", manifest)
    before = repr(read_dcp_metadata(backend, "step_0001", manifest))
    entry = first.state_dict_metadata["f32"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.size = torch.Size([1])
    entry.properties.dtype = torch.float64
    entry.chunks[0].sizes = torch.Size([1])
    entry.chunks.append(entry.chunks[0])
    for info in first.storage_data.values():
        info.offset += 1
    assert first.planner_data is not None
    for value in first.planner_data.values():
        if isinstance(value, dict):
            value.clear()
    assert repr(read_dcp_metadata(backend, "step_0001", manifest)) == before
    target = make_state(2)
    dcp_safe.load(target, checkpoint_id="step_0001", storage_reader=SafeStorageReader(root))
    assert torch.equal(target["f32"], make_state(1)["f32"])
    assert len(decodes) == 1
