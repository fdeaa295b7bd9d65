"""Tensor items without torch.save/torch.load: the bytes are torch's, the reads are verified.

The writer lays plain tensors down from a template of ``torch.save``'s bytes and the reader
reads items of that layout straight into their destination; both must stay indistinguishable
from torch's own format, and every byte read must still be checked.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    ConfigError,
    SafeStorageReader,
    SafeStorageWriter,
    WriterOptions,
)
from dcp_safe.adapters.tensor_records import layout_for, template_parts
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.reading import tensors as tensor_reads
from dcp_safe.torch_compat import save_tensor_without_crc

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (1,), (3,), (2, 3), (257, 300), (1, 1, 1), (70000,)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.rand(shape) * 100).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_plain_tensor_is_written_byte_for_byte_as_torch_save_writes_it(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = _sample(dtype, shape)
    parts = template_parts(tensor)
    assert parts is not None
    theirs = io.BytesIO()
    save_tensor_without_crc(tensor, theirs)
    written, expected = b"".join(parts), theirs.getvalue()
    layout = layout_for(dtype, shape)
    assert layout is not None and len(written) == len(expected) == layout.length
    # Everything but the 40-digit serialization id, which torch draws anew for each save.
    at = len(expected) - len(layout.suffix) + layout.id_at
    assert written[:at] == expected[:at] and written[at + 40 :] == expected[at + 40 :]
    loaded = torch.load(io.BytesIO(written), weights_only=True)
    assert loaded.dtype == dtype and torch.equal(loaded, tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0),  # torch lays an empty storage out differently
        torch.zeros(3, dtype=torch.float8_e4m3fn),  # pickled through UntypedStorage
        torch.zeros(3, dtype=torch.uint16),
        torch.arange(6.0).reshape(2, 3).t(),  # not contiguous
        torch.arange(6.0)[2:],  # a storage offset
        torch.zeros(3, requires_grad=True),
    ],
    ids=["empty", "float8", "uint16", "transposed", "offset", "requires_grad"],
)
def test_anything_else_is_left_to_torch_save(tensor: torch.Tensor) -> None:
    assert template_parts(tensor) is None


def _state() -> dict[str, Any]:
    return {
        "small": torch.randn(7, 5),
        "large": torch.randn(600, 1000),  # 2.4 MB: read in chunks
        "half": torch.randn(33).to(torch.bfloat16),
        "step": torch.tensor(12),
        "empty": torch.zeros(0, 4),
        "f8": torch.randn(10).to(torch.float8_e4m3fn),
        "extra": {"epoch": 3, "name": "run"},
    }


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v)
        for k, v in state.items()
    }


def _assert_loaded(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype, key
            assert torch.equal(loaded[key].float(), value.float()), key
        else:
            assert loaded[key] == value


def test_torch_reader_loads_what_the_template_wrote(tmp_path: Path) -> None:
    state = _state()
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))
    target = _blank(state)
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "step_1"), no_dist=True)
    _assert_loaded(target, state)


@pytest.fixture
def no_torch_load(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.load counts its callers' items: plain tensors must never reach it."""
    calls: list[str] = []
    real = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        loaded = real(*args, **kwargs)
        calls.append(
            type(loaded).__name__ if not isinstance(loaded, torch.Tensor) else str(loaded.dtype)
        )
        return loaded

    monkeypatch.setattr(torch, "load", counting)
    return calls


def test_plain_tensors_are_read_without_torch_load_and_verified(
    tmp_path: Path, no_torch_load: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensor_reads, "_CHUNK_BYTES", 256 << 10)  # several chunks, hashed aside
    state = _state()
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))
    target = _blank(state)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=SafeStorageReader(tmp_path))
    _assert_loaded(target, state)
    # No tensor went through torch.load: the template covers the plain ones, and what it does
    # not cover (the float8 tensor) goes through dcp_safe's own bounded item decoder (DCP reads
    # no bytes for the empty one; the object item is DCP's own load, in the planner).
    assert [c for c in no_torch_load if c.startswith("torch.")] == []


def test_a_resharded_or_strided_destination_gets_the_same_values(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 48)}
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))
    strided = torch.zeros(48, 64).t()  # not contiguous: read aside, then copied in
    dcp_safe.load(
        {"w": strided}, checkpoint_id="step_1", storage_reader=SafeStorageReader(tmp_path)
    )
    assert torch.equal(strided, state["w"])
    as_double = {"w": torch.zeros(64, 48, dtype=torch.float64)}  # another dtype: converted
    dcp_safe.load(as_double, checkpoint_id="step_1", storage_reader=SafeStorageReader(tmp_path))
    assert torch.equal(as_double["w"], state["w"].double())


def _flip_in_item(root: Path, name: str, fqn: str, where: str) -> None:
    manifest = open_committed(open_backend(str(root)), name).manifest
    [record] = [r for r in manifest.items if r.fqn == fqn]
    layout = layout_for(torch.float32, (600, 1000) if fqn == "large" else (7, 5))
    assert layout is not None
    offset = {
        "header": 40,
        "payload": len(layout.prefix) + layout.payload // 2,
        "directory": record.length - 30,
    }[where]
    path = root / name / record.file
    data = bytearray(path.read_bytes())
    data[record.start + offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fqn", ["small", "large"])
@pytest.mark.parametrize("where", ["header", "payload", "directory"])
def test_a_flipped_byte_anywhere_in_an_item_is_refused(
    tmp_path: Path, fqn: str, where: str
) -> None:
    state = _state()
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))
    _flip_in_item(tmp_path, "step_1", fqn, where)
    with pytest.raises(CheckpointCorruptError) as info:
        dcp_safe.load(
            _blank(state), checkpoint_id="step_1", storage_reader=SafeStorageReader(tmp_path)
        )
    assert "checksum mismatch" in str(info.value) and fqn in str(info.value)


def test_files_are_read_in_parallel_and_a_failure_in_any_reaches_the_caller(
    tmp_path: Path,
) -> None:
    state = {f"p{i}": torch.randn(100, 10) for i in range(12)}
    writer = SafeStorageWriter(tmp_path, options=WriterOptions(thread_count=4))
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)
    assert len(list((tmp_path / "step_1").glob("*.distcp"))) == 4
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = SafeStorageReader(tmp_path, thread_count=4)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    _flip_in_item_named(tmp_path, "p7")
    with pytest.raises(CheckpointCorruptError, match="p7"):
        dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)


def _flip_in_item_named(root: Path, fqn: str) -> None:
    manifest = open_committed(open_backend(str(root)), "step_1").manifest
    [record] = [r for r in manifest.items if r.fqn == fqn]
    path = root / "step_1" / record.file
    data = bytearray(path.read_bytes())
    data[record.start + record.length // 2] ^= 0x80
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_a_bad_thread_count_is_a_config_error(tmp_path: Path, count: Any) -> None:
    with pytest.raises(ConfigError, match="thread_count"):
        SafeStorageReader(tmp_path, thread_count=count)
