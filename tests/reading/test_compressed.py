"""zstd tensor items are decompressed in pieces straight into their target, verified.

The checksum is of the stored (compressed) bytes, hashed in file order as they are read; an
item the streamed path cannot take (a frame needing a larger window) is decoded whole instead.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from support import assert_state_equal

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.adapters.tensor_records import layout_for, template_parts
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.items import ZSTD_DESCRIPTOR
from dcp_safe.manifest.checksum import format_checksum, new_hasher
from dcp_safe.manifest.schema import ItemRecord
from dcp_safe.reading.tensors import read_tensor_item


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(5 << 20, generator=gen),  # 20 MiB: more than one decompressed piece
        "zeros": torch.zeros(1 << 20),  # compresses ~1000x
        "half": torch.randn(300, 7, generator=gen).to(torch.bfloat16),
    }


def _save(root: Path, state: dict[str, Any]) -> None:
    writer = SafeStorageWriter(root, options=WriterOptions(compression="zstd", fsync=False))
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)


def _load(root: Path, state: dict[str, Any], **options: Any) -> dict[str, Any]:
    target = {key: torch.full_like(value, 7) for key, value in state.items()}
    reader = SafeStorageReader(root, **options)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    return target


@pytest.mark.parametrize("verify", [True, False])
def test_zstd_items_load_exactly_streamed_into_their_targets(tmp_path: Path, verify: bool) -> None:
    state = _state()
    _save(tmp_path, state)
    assert_state_equal(_load(tmp_path, state, verify=verify, load_budget_bytes=1), state)


def test_a_flipped_byte_in_a_zstd_item_is_a_checksum_mismatch(tmp_path: Path) -> None:
    state = _state()
    _save(tmp_path, state)
    manifest = open_committed(open_backend(str(tmp_path)), "step_1").manifest
    victim = next(i for i in manifest.items if i.fqn == "big")
    shard = tmp_path / "step_1" / victim.file
    data = bytearray(shard.read_bytes())
    data[victim.start + victim.length // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as info:
        _load(tmp_path, state)
    assert str(info.value.item).startswith("big") and info.value.expected == victim.checksum


def test_a_frame_that_needs_a_larger_window_is_left_to_the_whole_item_decoder() -> None:
    tensor = torch.randn(3 << 20)  # 12 MiB: a window of 32 MiB holds all of it
    parts = template_parts(tensor)
    assert parts is not None
    plain = b"".join(parts)
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=25)
    packed = zstandard.ZstdCompressor(compression_params=params).compress(plain)
    layout = layout_for(tensor.dtype, tuple(tensor.shape))
    assert layout is not None
    dest = torch.empty_like(tensor)
    record = ItemRecord(
        fqn="t",
        offset=None,
        file="t.distcp",
        start=0,
        length=len(packed),
        checksum="crc32:00000000",
        transforms=(ZSTD_DESCRIPTOR,),
    )
    streamed = read_tensor_item(
        io.BytesIO(packed),
        path="mem",
        item="t",
        record=record,
        layout=layout,
        checksum=None,
        dest=dest,
    )
    assert streamed is False  # the reader then decodes it whole, as before


def _stored(tensor: torch.Tensor, *, zstd: bool) -> tuple[bytes, ItemRecord]:
    """``tensor`` as an item at offset 5 of a file with bytes after it, and its record."""
    parts = template_parts(tensor)
    assert parts is not None
    plain = b"".join(parts)
    data = zstandard.ZstdCompressor().compress(plain) if zstd else plain
    hasher = new_hasher("sha256", size_hint=len(data))
    hasher.update(data)
    record = ItemRecord(
        fqn="t",
        offset=None,
        file="t.distcp",
        start=5,
        length=len(data),
        checksum=format_checksum("sha256", hasher),
        transforms=(ZSTD_DESCRIPTOR,) if zstd else (),
    )
    return b"head!" + data + b"next item", record


@pytest.mark.parametrize("zstd", [False, True], ids=["plain", "zstd"])
@pytest.mark.parametrize("numel", [100_000, 9 << 20], ids=["whole", "chunked"])
@pytest.mark.parametrize("pooled", [False, True], ids=["inline", "pool"])
def test_a_tensor_item_is_read_verified_whatever_its_size_or_transform(
    zstd: bool, numel: int, pooled: bool
) -> None:
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    stored, record = _stored(tensor, zstd=zstd)
    layout = layout_for(tensor.dtype, tuple(tensor.shape))
    assert layout is not None

    def read(data: bytes) -> torch.Tensor:
        dest = torch.empty_like(tensor)
        with ThreadPoolExecutor(1) as pool:
            assert read_tensor_item(
                io.BytesIO(data),
                path="mem",
                item="t",
                record=record,
                layout=layout,
                checksum=record.checksum,
                dest=dest,
                hash_pool=pool if pooled else None,
            )
        return dest

    assert torch.equal(read(stored), tensor)
    flipped = bytearray(stored)
    flipped[5 + record.length // 2] ^= 1  # in the payload
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        read(bytes(flipped))
    with pytest.raises(CheckpointCorruptError, match="file is shorter than the manifest says"):
        read(stored[: 5 + record.length - 1])
