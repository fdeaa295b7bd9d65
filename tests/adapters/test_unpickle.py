"""Loading never runs code from a checkpoint: hostile pickles are refused, plain data loads.

The attacker here can write the root: they replace a file and rewrite the manifest's checksum
and the marker's digest to match, so every integrity check passes. The payloads are live (with
``allow_pickle=True`` they create a sentinel file), so a refusal is a refusal of real code.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.faults import Planted

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageReader, SafeStorageWriter, layout
from dcp_safe.errors import UnsafeCheckpointError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.schema import Manifest, manifest_digest


def _replace_file(root: Path, name: str, rel: str, data: bytes) -> None:
    """Write ``data`` at ``name/rel`` and re-sign manifest and marker, as a root writer can."""
    (root / name / rel).write_bytes(data)
    manifest_path = root / name / layout.MANIFEST
    manifest = Manifest.from_json(manifest_path.read_bytes(), str(manifest_path))
    files = tuple(
        dataclasses.replace(
            f,
            size=len(data),
            checksum=digest_bytes(data, ChecksumAlgorithm(f.checksum.partition(":")[0])),
        )
        if f.path == rel and f.checksum is not None
        else f
        for f in manifest.files
    )
    raw = dataclasses.replace(manifest, files=files).to_json()
    manifest_path.write_bytes(raw)
    (root / name / layout.COMMITTED_MARKER).write_bytes(manifest_digest(raw).encode())


def _saved(root: Path, state: dict[str, Any], name: str = "step_1") -> None:
    dcp_safe.save(state, checkpoint_id=name, storage_writer=SafeStorageWriter(root))


def test_a_planted_metadata_pickle_is_never_unpickled(tmp_path: Path) -> None:
    # Loads read DCP's metadata from the manifest's plain form: a live payload planted in
    # .metadata (re-signed) is never unpickled, not even with allow_pickle=True.
    root, sentinel = tmp_path / "root", tmp_path / "ran"
    _saved(root, {"w": torch.arange(4.0)})
    _replace_file(root, "step_1", layout.DCP_METADATA, pickle.dumps(Planted(sentinel)))
    for allow_pickle in (False, True):
        target = {"w": torch.zeros(4)}
        reader = SafeStorageReader(root, allow_pickle=allow_pickle)
        dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
        assert torch.equal(target["w"], torch.arange(4.0))
    assert dcp_safe.verify_checkpoint(root, "step_1").name == "step_1"
    assert not sentinel.exists()


def test_without_plain_metadata_a_load_needs_allow_pickle(tmp_path: Path) -> None:
    # A checkpoint written before the plain form existed has only the pickle: refused (and not
    # unpickled) unless the caller trusts the root, and then it loads.
    root = tmp_path / "root"
    _saved(root, {"w": torch.arange(4.0)})
    _strip_plain_metadata(root, "step_1")
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True") as caught:
        SafeStorageReader(root).reset("step_1")
    assert caught.value.path.endswith(layout.DCP_METADATA)
    target = {"w": torch.zeros(4)}
    reader = SafeStorageReader(root, allow_pickle=True)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert torch.equal(target["w"], torch.arange(4.0))


def test_garbage_metadata_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _saved(root, {"w": torch.ones(4)})
    _strip_plain_metadata(root, "step_1")
    _replace_file(root, "step_1", layout.DCP_METADATA, b"\x80\x05not a pickle at all")
    with pytest.raises(CheckpointCorruptError, match="not DCP metadata"):
        SafeStorageReader(root, allow_pickle=True).reset("step_1")


def _strip_plain_metadata(root: Path, name: str) -> None:
    """Make ``name`` look as checkpoints written before the plain metadata did (re-signed)."""
    manifest_path = root / name / layout.MANIFEST
    manifest = Manifest.from_json(manifest_path.read_bytes(), str(manifest_path))
    raw = dataclasses.replace(manifest, dcp_metadata=None).to_json()
    manifest_path.write_bytes(raw)
    (root / name / layout.COMMITTED_MARKER).write_bytes(manifest_digest(raw).encode())


def test_an_object_item_that_would_run_code_is_refused_by_name(tmp_path: Path) -> None:
    root, sentinel = tmp_path / "root", tmp_path / "ran"
    # Written by SafeStorageWriter itself: DCP pickles non-tensor values as they are.
    _saved(root, {"w": torch.ones(4), "extra": {"hook": Planted(sentinel)}})
    target: dict[str, Any] = {"w": torch.zeros(4), "extra": {"hook": None}}

    with pytest.raises(UnsafeCheckpointError) as caught:
        dcp_safe.load(target, checkpoint_id="step_1", storage_reader=SafeStorageReader(root))
    assert "extra.hook" in str(caught.value.item)
    # DCP's own load call is just as safe; DCP wraps the error in its CheckpointException.
    with pytest.raises(BaseException) as wrapped:
        dcp.load(target, checkpoint_id="step_1", storage_reader=SafeStorageReader(root))
    [(cause, _)] = wrapped.value.failures.values()  # type: ignore[attr-defined]
    assert isinstance(cause, UnsafeCheckpointError)
    assert not sentinel.exists()

    dcp.load(
        target, checkpoint_id="step_1", storage_reader=SafeStorageReader(root, allow_pickle=True)
    )
    assert sentinel.exists()


def test_plain_data_and_tensors_still_load_exactly(tmp_path: Path) -> None:
    root = tmp_path / "root"
    state: dict[str, Any] = {
        "w": torch.arange(6.0),
        "config": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adamw", "flags": [True, None]},
        "order": collections.OrderedDict(a=1, b=2),
        "step": 7,
        "tensor_in_object": {"ema": torch.full((2,), 3.0)},
    }
    _saved(root, state)
    target: dict[str, Any] = {
        "w": torch.zeros(6),
        "config": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "flags": [False, False]},
        "order": collections.OrderedDict(a=0, b=0),
        "step": 0,
        "tensor_in_object": {"ema": torch.zeros(2)},
    }
    dcp.load(target, checkpoint_id="step_1", storage_reader=SafeStorageReader(root))
    assert torch.equal(target["w"], state["w"])
    assert target["config"] == state["config"]
    assert target["order"] == state["order"] and target["step"] == 7
    assert torch.equal(target["tensor_in_object"]["ema"], state["tensor_in_object"]["ema"])


def _train_state(rank: int) -> dict[str, Any]:
    """A train state as PyTorch's own DCP e2e test saves it: losses torch.saved into a BytesIO,
    next to plain Python data and a tensor."""
    losses = io.BytesIO()
    torch.save([0.5 + rank, 0.25, 0.125], losses)
    return {"w": torch.arange(4.0), "losses": losses, "meta": {"epoch": 3, "tag": "run7"}}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(4), "losses": io.BytesIO(), "meta": {"epoch": 0, "tag": ""}}


def _check_train_state(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert torch.equal(loaded["w"], saved["w"]) and loaded["meta"] == saved["meta"]
    assert isinstance(loaded["losses"], io.BytesIO)
    assert loaded["losses"].getvalue() == saved["losses"].getvalue()
    assert torch.load(io.BytesIO(loaded["losses"].getvalue())) == [0.5, 0.25, 0.125]


def test_dcps_own_bytesio_entries_load_by_default(tmp_path: Path) -> None:
    """DCP documents io.BytesIO for opaque bytes and pickles the object itself; it loads with
    no allow_pickle, rebuilt from its bytes (it was refused as "not plain data")."""
    root = tmp_path / "root"
    saved = _train_state(0)
    _saved(root, saved)
    loaded = _blank()
    dcp_safe.load(loaded, checkpoint_id="step_1", storage_reader=SafeStorageReader(root))
    _check_train_state(loaded, saved)
    assert dcp_safe.verify_checkpoint(root, "step_1").name == "step_1"


def test_a_pickled_bytesio_that_sets_attributes_or_calls_anything_else_is_refused(
    tmp_path: Path,
) -> None:
    from dcp_safe.checkpoints.items import sanitized_object_stream

    def torch_zip(payload: bytes) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(None, buffer)  # a real torch zip; its pickle is then swapped
        import zipfile

        out = io.BytesIO()
        with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                data = payload if info.filename.endswith("/data.pkl") else src.read(info)
                dst.writestr(info, data)
        out.seek(0)
        return out

    with_attrs = io.BytesIO(b"x")
    with_attrs.planted = "yes"  # type: ignore[attr-defined]
    for hostile in (pickle.dumps(with_attrs, protocol=2), pickle.dumps(Planted(tmp_path / "r"))):
        with pytest.raises(UnsafeCheckpointError):
            sanitized_object_stream(torch_zip(hostile), "p", "losses")
    assert not (tmp_path / "r").exists()


def _bytesio_on_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _train_state(0)  # the same on every rank: replicated, saved once
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    loaded = _blank()
    dcp_safe.load(loaded, checkpoint_id="step_1", storage_reader=SafeStorageReader(root))
    _check_train_state(loaded, state)
    return {"losses": loaded["losses"].getvalue()}


@pytest.mark.multiproc
def test_bytesio_entries_load_by_default_on_two_ranks(tmp_path: Path) -> None:
    from dcp_safe.testing.multiproc import run_ranks

    results = run_ranks(_bytesio_on_ranks, 2, args=(str(tmp_path),))
    assert results[0] == results[1]
