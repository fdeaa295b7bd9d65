"""Importing Hugging Face safetensors weights (issue #46, "Import from safetensors").

Files are written here byte by byte in the safetensors format (8-byte little-endian header
length, JSON header, raw data), and one by the ``safetensors`` library itself (the reference
writer, with its own padding). Checked: a model folder holding one ``model.safetensors``, and
one sharded with ``model.safetensors.index.json``, restore bit-exact into an FSDP2 model over 2
gloo ranks (uneven rows), through ``Resume(initial_load_from=)`` and ``restore(source=)``; a
truncated file is refused on every rank with ``CheckpointCorruptError`` naming the file and the
tensor the file ends inside, and the target is left as it was; the name map (prefix, leave out,
collision); every header inconsistency; sources on ``memory://`` and moto S3; the source and its
digest (sha256 of the index and each file's name, size and header) in the history.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_safe import CheckpointCorruptError, CheckpointManager, Resume, Runtime
from dcp_safe.errors import CheckpointNotFoundError, ConfigError
from dcp_safe.manager import SafetensorsSource
from dcp_safe.testing.multiproc import run_ranks

_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}


def _encode(tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """A safetensors file holding ``tensors`` in this order: (header part, data part)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data, at = [], 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [at, at + len(raw)],
        }
        data.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, b"".join(data)


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    """Write the file; returns its header part (length prefix and JSON)."""
    head, data = _encode(tensors)
    path.write_bytes(head + data)
    return head


def _weights() -> dict[str, torch.Tensor]:
    """Weights for ``_net()`` (31 rows in the first layer, uneven over 2 ranks) and a plain
    tensor every rank loads whole (read by one rank, sent to the other: read once)."""
    gen = torch.Generator().manual_seed(7)
    shapes = {"0.weight": (31, 8), "0.bias": (31,), "2.weight": (5, 31), "2.bias": (5,)}
    shapes["scale"] = (3,)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _folder(path: Path, sharded: bool) -> str:
    """A model folder with ``_weights()``: one file, or two shards and their index (whose
    digest the history must record: returned as ``path/digest``)."""
    path.mkdir()
    weights = _weights()
    if not sharded:
        head = _write(path / "model.safetensors", weights)
        size = (path / "model.safetensors").stat().st_size
        hasher = hashlib.sha256(b"model.safetensors\0%d\0" % size + head)
    else:
        names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        parts = [{k: v for k, v in weights.items() if k.startswith("0.") == s} for s in (1, 0)]
        weight_map = {key: name for name, part in zip(names, parts, strict=True) for key in part}
        index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        (path / "model.safetensors.index.json").write_bytes(index)
        hasher = hashlib.sha256(index)
        for name, part in zip(names, parts, strict=True):
            head = _write(path / name, part)
            hasher.update(b"%s\0%d\0" % (name.encode(), (path / name).stat().st_size) + head)
    (path / "digest").write_text(f"sha256:{hasher.hexdigest()}")
    return str(path)


def _truncated(source: str, dest: Path) -> Path:
    """A copy of the single-file folder ``source`` whose file ends 10 bytes into ``2.bias``
    (the last tensor, ``scale``, is gone)."""
    shutil.copytree(source, dest)
    file = dest / "model.safetensors"
    size = file.stat().st_size
    with file.open("r+b") as f:
        f.truncate(size - 3 * 4 - 5 * 4 + 10)
    return dest


def _net(world_size: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 31), nn.ReLU(), nn.Linear(31, 5))
    fully_shard(net, mesh=init_device_mesh("cpu", (world_size,)))
    return net


def _restore_on_ranks(
    rank: int, world_size: int, source: str, broken: str, root: str
) -> dict[str, Any]:
    net = _net(world_size)
    state = {**net.state_dict(), "scale": torch.zeros(3)}
    resume = Resume(initial_load_from=source)
    with CheckpointManager(root, resume=resume, runtime=Runtime(executor="thread")) as manager:
        report = manager.restore(state)
        before = {k: getattr(v, "full_tensor", v.clone)() for k, v in state.items()}
        try:
            manager.restore(state, source=broken)
            refused = "restored"
        except CheckpointCorruptError as exc:
            refused = str(exc)
        events = [e for e in manager.history() if e["event"] == "restored"]
    after = {k: getattr(v, "full_tensor", v.clone)() for k, v in state.items()}
    return {
        "restored": report.restored,
        "full": before,
        "unchanged": all(torch.equal(after[k], before[k]) for k in before),
        "refused": refused,
        "events": events,
        "rows": net[0].weight.to_local().shape[0],
    }


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_model_folder_restores_into_a_two_rank_fsdp2_model_bit_exact(
    tmp_path: Path, sharded: bool
) -> None:
    source = _folder(tmp_path / "model", sharded)
    broken = _truncated(_folder(tmp_path / "single", False), tmp_path / "broken")

    ranks = run_ranks(_restore_on_ranks, 2, args=(source, str(broken), str(tmp_path / "run")))

    weights = _weights()
    assert [r["rows"] for r in ranks] == [16, 15]  # FSDP2 sharded the 31 rows unevenly
    for seen in ranks:
        assert sorted(seen["restored"]) == sorted(weights)
        assert all(torch.equal(seen["full"][k], weights[k]) for k in weights)
        assert "model.safetensors" in seen["refused"] and "item 2.bias" in seen["refused"]
        assert "ends inside this tensor (truncated)" in seen["refused"]
        assert seen["unchanged"]  # refused before any byte was read
    [event] = ranks[0]["events"]
    assert event["tier"] == "initial" and event["source"].startswith(source)
    assert event["source_digest"] == (tmp_path / "model" / "digest").read_text()


def test_a_file_the_safetensors_library_wrote_restores_with_a_name_map(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {**_weights(), "lm_head.weight": torch.ones(2, 2), "step": torch.tensor(3)}
    weights["2.bias"] = weights["2.bias"].to(torch.bfloat16)
    (tmp_path / "hf").mkdir()
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    target: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in weights.items() if k[0].isdigit()},
        "optim": {"lr": 0.1},
    }

    def name_map(name: str) -> str | None:
        return None if name == "lm_head.weight" else f"model.{name}"

    source = SafetensorsSource(tmp_path / "hf" / "model.safetensors", name_map=name_map)
    with CheckpointManager(tmp_path / "run") as manager:
        report = manager.restore(target, source=source, keys=["model"])
    assert report == "model.safetensors" and report.skipped == ("optim.lr",)
    assert report.unexpected == ("model.scale", "model.step")
    for key, value in target["model"].items():
        assert value.dtype == weights[key].dtype and torch.equal(value, weights[key]), key

    clash = SafetensorsSource(tmp_path / "hf", name_map=lambda name: "model.x")
    with CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(ConfigError, match=r"name_map gives 'model\.x' for both"):
            manager.restore(target, source=clash)
        with pytest.raises(CheckpointNotFoundError, match=r"no model\.safetensors\.index\.json"):
            manager.restore(target, source=SafetensorsSource(tmp_path / "run"))
        with pytest.raises(ConfigError, match="takes no step"):
            manager.restore(target, 3, source=source)


def _bad(header: dict[str, Any], data: bytes = b"\0" * 16) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


_F = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
_G = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\x01\x02", "header length does not fit"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length does not fit"),
        (_bad({"a": _F, "b": _G}, b"\0" * 12), r"item b.*ends inside this tensor"),
        (_bad({"a": _F, "b": _G}, b"\0" * 20), "bytes after the last tensor"),
        (_bad({"a": _F, "b": {**_G, "data_offsets": [9, 17]}}, b"\0" * 17), "leave a gap"),
        (_bad({"a": _F, "b": {**_G, "data_offsets": [4, 12]}}, b"\0" * 12), "overlap"),
        (_bad({"a": {**_F, "shape": [3]}}, b"\0" * 8), "do not span dtype x shape"),
        (_bad({"a": {**_F, "dtype": "F4"}}, b"\0" * 8), "not {dtype, shape, data_offsets}"),
        (_bad({"a": {**_F, "shape": [-2]}}, b"\0" * 8), "not {dtype, shape, data_offsets}"),
        (_bad([1]), "not a JSON object"),  # type: ignore[arg-type]
    ],
    ids=[
        "short",
        "huge",
        "truncated",
        "trailing",
        "gap",
        "overlap",
        "span",
        "dtype",
        "shape",
        "list",
    ],
)
def test_a_header_that_disagrees_with_itself_or_the_file_is_refused(
    tmp_path: Path, raw: bytes, match: str
) -> None:
    (tmp_path / "model.safetensors").write_bytes(raw)
    target = {"a": torch.zeros(2)}
    with (
        CheckpointManager(tmp_path / "run") as manager,
        pytest.raises(CheckpointCorruptError, match=match),
    ):
        manager.restore(target, source=str(tmp_path))
    assert torch.equal(target["a"], torch.zeros(2))


def test_an_index_that_disagrees_with_its_files_is_refused(tmp_path: Path) -> None:
    source = Path(_folder(tmp_path / "model", sharded=True))
    index = source / "model.safetensors.index.json"
    document = json.loads(index.read_bytes())
    document["weight_map"]["0.extra"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(document))
    match = r"disagree on tensors \['0\.extra'\]"
    with (
        CheckpointManager(tmp_path / "run") as manager,
        pytest.raises(CheckpointCorruptError, match=match),
    ):
        manager.restore(dict(_weights()), source=str(index))


def _upload(fs: Any, base: str, sharded_folder: str) -> None:
    for file in sorted(Path(sharded_folder).iterdir()):
        fs.pipe_file(f"{base}/{file.name}", file.read_bytes())


def test_a_source_on_an_fsspec_file_system_restores(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    _upload(fs, "/hf-import/model", _folder(tmp_path / "model", sharded=True))
    target = {k: torch.zeros_like(v) for k, v in _weights().items()}
    with CheckpointManager(tmp_path / "run") as manager:
        manager.restore(target, source=SafetensorsSource("memory://hf-import/model"))
        [event] = [e for e in manager.history() if e["event"] == "restored"]
    assert all(torch.equal(target[k], v) for k, v in _weights().items())
    assert event["source_digest"] == (tmp_path / "model" / "digest").read_text()
    fs.rm("/hf-import", recursive=True)


@pytest.mark.s3
def test_a_warm_start_from_a_model_folder_on_s3(
    tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options)
    _upload(fs, f"{s3_bucket}/llm", _folder(tmp_path / "model", sharded=False))
    source = SafetensorsSource(f"s3://{s3_bucket}/llm", storage_options=s3_options)
    target = {k: torch.zeros_like(v) for k, v in _weights().items()}
    with CheckpointManager(tmp_path / "run", resume=Resume(initial_load_from=source)) as manager:
        assert manager.restore(target) == "model.safetensors"
    assert all(torch.equal(target[k], v) for k, v in _weights().items())
