"""``dcp_safe.export``: real DCP saves exported, then loaded by safetensors and torch themselves.

Every round trip compares bit for bit (``torch.equal`` on the same dtype) with the state that
was saved, or with that state cast by ``Tensor.to`` when a dtype was asked for. Failures are
checked for what they leave behind: nothing at ``dest`` and no hidden work folder beside it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import dcp_safe
from dcp_safe import CheckpointCorruptError, ConfigError, SafeStorageWriter, WriterOptions
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.exporting import ExportFormat

NAME = "step_0001"


def _state() -> dict[str, Any]:
    """Nested state (DCP flattens it to dotted keys) of several dtypes, one tensor over 1 MiB
    (read in chunks by the reader), a 0-d and an empty tensor, and plain objects."""
    gen = torch.Generator().manual_seed(7)
    return {
        "model": {
            "embed": {"weight": torch.randn(512, 640, generator=gen)},  # 1.25 MiB
            "layer": {
                "weight": torch.randn(24, 16, generator=gen).to(torch.bfloat16),
                "bias": torch.randn(16, generator=gen).to(torch.float16),
            },
            "steps": torch.randint(-(2**40), 2**40, (7,), generator=gen),
            "mask": torch.randint(0, 2, (9,), generator=gen).bool(),
            "scale": torch.tensor(0.5, dtype=torch.float64),
            "empty": torch.empty(0, 3),
        },
        "extra": {"epoch": 3, "tag": "run7", "history": [1.5, 2.5]},
    }


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _flat(state).items() if isinstance(v, torch.Tensor)}


def _save(root: Path | str, state: dict[str, Any], name: str = NAME, step: int = 1) -> None:
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False), step=step)
    dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    _save(path, _state())
    return path


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert actual[key].shape == value.shape, key
        assert torch.equal(actual[key], value), key


def _assert_nothing_left(dest: Path) -> None:
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir() if ".export-" in p.name] == []


def _assert_checksums(dest: Path) -> None:
    lines = (dest / "SHA256SUMS").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, name = line.split("  ")
        listed[name] = digest
    assert sorted(listed) == sorted(p.name for p in dest.iterdir() if p.name != "SHA256SUMS")
    for name, digest in listed.items():
        assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == digest, name


def _flip_byte_in(root: Path, fqn: str, name: str = NAME) -> None:
    """Flip one byte in the middle of ``fqn``'s stored item (its first chunk)."""
    manifest = open_committed(open_backend(str(root)), name).manifest
    item = next(i for i in manifest.items if i.fqn == fqn)
    path = root / name / item.file
    data = bytearray(path.read_bytes())
    data[item.start + item.length // 2] ^= 0x40
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------- safetensors


def test_safetensors_single_file_loads_with_safetensors_bit_for_bit(
    root: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    result = dcp_safe.export(root, NAME, dest)
    assert result.format is ExportFormat.SAFETENSORS
    assert result.files == ("SHA256SUMS", "model.safetensors")
    assert sorted(p.name for p in dest.iterdir()) == list(result.files)
    expected = _tensors(_state())
    _assert_same(load_file(dest / "model.safetensors"), expected)
    assert result.tensors == len(expected)
    assert result.tensor_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert sorted(result.skipped) == ["extra.epoch", "extra.history", "extra.tag"]
    assert all("not a tensor" in why for why in result.skipped.values())
    with safe_open(str(dest / "model.safetensors"), framework="pt") as opened:
        assert opened.metadata()["format"] == "pt"
    _assert_checksums(dest)
    _assert_nothing_left(tmp_path / "never")  # no work folder beside dest either


def test_safetensors_sharded_with_an_index_as_hugging_face_lays_it_out(
    root: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    max_shard = 64 << 10  # the 1.25 MiB embedding gets a shard of its own
    result = dcp_safe.export(root, NAME, dest, max_shard_bytes=max_shard)
    shards = sorted(p.name for p in dest.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    assert not (dest / "model.safetensors").exists()
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    expected = _tensors(_state())
    assert sorted(index["weight_map"]) == sorted(expected)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == result.tensor_bytes
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(dest / shard)
        assert all(index["weight_map"][key] == shard for key in part)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= max_shard or len(part) == 1
        loaded.update(part)
    _assert_same(loaded, expected)
    _assert_checksums(dest)


def test_safetensors_many_small_shards_keep_key_order(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dcp_safe.export(root, NAME, dest, max_shard_bytes=1)  # every tensor alone
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    expected = _tensors(_state())
    files = [index["weight_map"][key] for key in sorted(expected)]
    assert files == sorted(files) and len(set(files)) == len(expected)
    loaded: dict[str, torch.Tensor] = {}
    for name in set(files):
        loaded.update(load_file(dest / name))
    _assert_same(loaded, expected)


def test_safetensors_with_a_dtype_cast_matches_tensor_to(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    result = dcp_safe.export(root, NAME, dest, dtype=torch.bfloat16)
    expected = {
        key: value.to(torch.bfloat16) if value.is_floating_point() else value
        for key, value in _tensors(_state()).items()
    }
    _assert_same(load_file(dest / "model.safetensors"), expected)
    assert result.tensor_bytes == sum(t.numel() * t.element_size() for t in expected.values())


# ------------------------------------------------------------------------------------- torch


def test_torch_file_loads_weights_only_bit_for_bit_with_plain_objects(
    root: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    result = dcp_safe.export(root, NAME, dest, format="torch")
    assert result.files == ("SHA256SUMS", "model.pt")
    assert result.objects == 3 and dict(result.skipped) == {}
    for mmap in (False, True):
        loaded = torch.load(dest / "model.pt", weights_only=True, mmap=mmap)
        _assert_same(
            {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, _tensors(_state())
        )
        assert loaded["extra.epoch"] == 3
        assert loaded["extra.tag"] == "run7"
        assert loaded["extra.history"] == [1.5, 2.5]
        assert list(loaded) == sorted(loaded)
    _assert_checksums(dest)


def test_torch_file_is_a_sound_zip_with_aligned_tensor_records(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dcp_safe.export(root, NAME, dest, format="torch")
    raw = (dest / "model.pt").read_bytes()
    with zipfile.ZipFile(dest / "model.pt") as archive:
        assert archive.testzip() is None  # every record's CRC-32 is right
        records = [info for info in archive.infolist() if "/data/" in info.filename]
        assert len(records) == len(_tensors(_state()))
        for info in records:
            name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            assert start % 64 == 0, info.filename


def test_torch_file_with_a_dtype_cast(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dcp_safe.export(root, NAME, dest, format="torch", dtype="float16", keys=["model"])
    loaded = torch.load(dest / "model.pt", weights_only=True)
    expected = {
        key: value.half() if value.is_floating_point() else value
        for key, value in _tensors(_state()).items()
    }
    _assert_same(loaded, expected)


def test_torch_refuses_float8_but_a_cast_or_safetensors_exports_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    values = torch.randn(32, generator=torch.Generator().manual_seed(1))
    _save(root, {"w8": values.to(torch.float8_e4m3fn), "b": values})
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        dcp_safe.export(root, NAME, tmp_path / "pt", format="torch")
    _assert_nothing_left(tmp_path / "pt")
    dcp_safe.export(root, NAME, tmp_path / "pt", format="torch", dtype=torch.float32)
    loaded = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert torch.equal(loaded["w8"], values.to(torch.float8_e4m3fn).float())
    dcp_safe.export(root, NAME, tmp_path / "st")
    stored = load_file(tmp_path / "st" / "model.safetensors")["w8"]
    assert stored.dtype == torch.float8_e4m3fn
    assert torch.equal(stored.view(torch.uint8), values.to(torch.float8_e4m3fn).view(torch.uint8))


# -------------------------------------------------------------------------------------- keys


def test_keys_select_exact_names_and_prefixes(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    result = dcp_safe.export(root, NAME, dest, keys=["model.layer", "model.steps"])
    tensors = _tensors(_state())
    expected = {k: tensors[k] for k in ("model.layer.weight", "model.layer.bias", "model.steps")}
    _assert_same(load_file(dest / "model.safetensors"), expected)
    assert dict(result.skipped) == {}


def test_a_prefix_matches_whole_name_parts_only(root: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'model\.lay'"):
        dcp_safe.export(root, NAME, tmp_path / "out", keys=["model.lay"])


def test_a_missing_key_is_a_config_error_and_writes_nothing(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"keys not in the checkpoint: 'model\.nope'"):
        dcp_safe.export(root, NAME, dest, keys=["model.embed", "model.nope"])
    _assert_nothing_left(dest)


def test_only_objects_selected_for_safetensors_is_nothing_to_export(
    root: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="no tensors"):
        dcp_safe.export(root, NAME, tmp_path / "out", keys=["extra"])
    result = dcp_safe.export(root, NAME, tmp_path / "pt", keys=["extra"], format="torch")
    loaded = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert loaded == {"extra.epoch": 3, "extra.history": [1.5, 2.5], "extra.tag": "run7"}
    assert result.tensors == 0


@pytest.mark.parametrize(
    "options",
    [{"format": "onnx"}, {"dtype": "int8"}, {"dtype": "nonsense"}]
    + [{"max_shard_bytes": bad} for bad in (0, -1, 1.5, True, "5GB")],
)
def test_bad_options_are_config_errors(root: Path, tmp_path: Path, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        dcp_safe.export(root, NAME, tmp_path / "out", **options)
    _assert_nothing_left(tmp_path / "out")


# ----------------------------------------------------------------------------------- failure


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("fqn", ["model.embed.weight", "model.layer.bias"])
def test_a_corrupt_item_fails_the_export_and_leaves_nothing(
    root: Path, tmp_path: Path, fmt: str, fqn: str
) -> None:
    _flip_byte_in(root, fqn)
    dest = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError) as caught:
        dcp_safe.export(root, NAME, dest, format=fmt)
    assert caught.value.item is not None and caught.value.item.startswith(fqn)
    _assert_nothing_left(dest)


def test_corruption_in_a_later_shard_removes_the_shards_already_written(
    root: Path, tmp_path: Path
) -> None:
    _flip_byte_in(root, "model.steps")  # last tensor in key order: its own last shard
    dest = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError):
        dcp_safe.export(root, NAME, dest, max_shard_bytes=1)
    _assert_nothing_left(dest)
    # Another selection, without the damaged tensor, still exports.
    dcp_safe.export(root, NAME, dest, keys=["model.layer"])
    assert (dest / "model.safetensors").is_file()


def test_a_missing_checkpoint_is_not_found(root: Path, tmp_path: Path) -> None:
    with pytest.raises(dcp_safe.CheckpointNotFoundError):
        dcp_safe.export(root, "step_0404", tmp_path / "out")
    _assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------------------- destination


def test_an_existing_dest_is_refused_unless_overwrite(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dcp_safe.export(root, NAME, dest, keys=["model.layer"])
    before = (dest / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="exists"):
        dcp_safe.export(root, NAME, dest)
    assert (dest / "model.safetensors").read_bytes() == before
    dcp_safe.export(root, NAME, dest, format="torch", overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == ["SHA256SUMS", "model.pt"]
    _assert_checksums(dest)
    assert [p.name for p in tmp_path.iterdir() if ".export-" in p.name] == []


def test_overwrite_replaces_only_an_earlier_export(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "precious"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an earlier export"):
        dcp_safe.export(root, NAME, dest, overwrite=True)
    assert (dest / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists"):
        dcp_safe.export(root, NAME, tmp_path / "file")


def test_a_failed_overwrite_keeps_the_earlier_export(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dcp_safe.export(root, NAME, dest)
    before = (dest / "model.safetensors").read_bytes()
    _flip_byte_in(root, "model.embed.weight")
    with pytest.raises(CheckpointCorruptError):
        dcp_safe.export(root, NAME, dest, overwrite=True)
    assert (dest / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if ".export-" in p.name] == []


def test_latest_is_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _save(root, {"w": torch.zeros(4)}, name="step_0001", step=1)
    _save(root, {"w": torch.ones(4)}, name="step_0002", step=2)
    result = dcp_safe.export(root, "latest", tmp_path / "out")
    assert result.checkpoint == "step_0002"
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], torch.ones(4))


def test_the_parent_of_dest_is_created(root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "a" / "b" / "out"
    dcp_safe.export(root, NAME, dest, keys=["model.steps"])
    assert (dest / "model.safetensors").is_file()


def test_an_fsspec_root_exports_like_a_local_one(memory_root: str, tmp_path: Path) -> None:
    _save(memory_root, _state())
    dcp_safe.export(memory_root, NAME, tmp_path / "out", format="torch")
    loaded = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    _assert_same(
        {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, _tensors(_state())
    )


def test_a_tensor_named_metadata_is_refused_up_front_for_safetensors(tmp_path: Path) -> None:
    """safetensors keeps ``__metadata__`` for its header: was a ``StorageError`` from the
    reader's check of the written file; now a ``ConfigError`` naming the key before any write,
    and the torch format still takes it."""
    state = {"__metadata__": torch.ones(3), "w": torch.zeros(2)}
    writer = SafeStorageWriter(tmp_path / "root", options=WriterOptions(fsync=False))
    dcp_safe.save(state, checkpoint_id=NAME, storage_writer=writer)
    with pytest.raises(ConfigError, match=r"reserves the key '__metadata__'.*format='torch'"):
        dcp_safe.export(tmp_path / "root", NAME, tmp_path / "out", format="safetensors")
    assert not (tmp_path / "out").exists()
    dcp_safe.export(tmp_path / "root", NAME, tmp_path / "out", format="torch")
    assert torch.equal(torch.load(tmp_path / "out" / "model.pt")["__metadata__"], torch.ones(3))
