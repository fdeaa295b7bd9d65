"""dcp_safe's own reader of ``torch.save`` archives, and the item decoders on top of it: what
torch writes reads back as torch wrote it; anything else is a typed refusal, never a raw error.
"""

from __future__ import annotations

import collections
import contextlib
import io
import random
import zipfile

import pytest
import torch
from hostile_items import call_pickle, torch_archive

from dcp_safe.checkpoints.items import decode_object, decode_tensor_item, decode_transforms
from dcp_safe.checkpoints.torch_zip import MemorySource, open_archive
from dcp_safe.errors import CheckpointCorruptError, DcpSafeError, UnsafeCheckpointError


def _saved(value: object) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def test_every_record_lies_where_zipfile_finds_it() -> None:
    data = _saved({"a": torch.arange(10), "b": [torch.ones(3), "x"]})
    archive = open_archive(MemorySource(data), "p", "i")
    with zipfile.ZipFile(io.BytesIO(data)) as reference:
        for info in reference.infolist():
            name = info.filename.partition("/")[2]
            assert bytes(archive.read(name) or b"") == reference.read(info)
    assert archive.prefix == "archive"


def test_large_records_in_zip64_form_are_read() -> None:
    data = torch_archive(b"\x80\x02K\x05.", zeros={"data/0": 1 << 20})
    with zipfile.ZipFile(io.BytesIO(data)) as check:
        assert check.getinfo("archive/data/0").file_size == 1 << 20
    assert open_archive(MemorySource(data), "p", "i").size("data/0") == 1 << 20


def test_a_compressed_record_is_refused_before_it_is_read() -> None:
    data = torch_archive(b"\x80\x02K\x05.", {"pad": bytes(4096)}, deflate={"pad"})
    with pytest.raises(UnsafeCheckpointError, match="compressed"):
        open_archive(MemorySource(data), "p", "i")


def test_more_records_than_allowed_are_refused_by_their_count() -> None:
    data = torch_archive(b"\x80\x02K\x05.", {f"r{n}": b"" for n in range(40)})
    with pytest.raises(UnsafeCheckpointError, match="records"):
        open_archive(MemorySource(data), "p", "i", max_records=16)


@pytest.mark.parametrize("cut", [0, 1, 21, 22, 100, -1, -22, -23])
def test_a_truncated_archive_is_corrupt(cut: int) -> None:
    data = _saved(torch.arange(10))
    with pytest.raises(CheckpointCorruptError):
        open_archive(MemorySource(data[:cut]), "p", "i")


def _damaged(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(out))
        out[at] = rng.randrange(256)
    return bytes(out)


def test_damaged_items_are_refused_typed_or_decode_within_bounds() -> None:
    """Byte flips anywhere in tensor and object items (archive, pickle, data): every outcome
    is a value or a dcp_safe error, never a raw exception from the zip or pickle machinery."""
    rng = random.Random(28)
    tensor = _saved(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    plain = _saved(
        {"lr": 0.1, "steps": [1, 2, 3], "t": torch.ones(2), "o": collections.OrderedDict(a=1)}
    )
    for _ in range(400):
        damaged = bytearray(_damaged(tensor, rng))
        with contextlib.suppress(DcpSafeError):
            decode_tensor_item(damaged, dtype=torch.float32, shape=(3, 4), path="p", item="t")
        with contextlib.suppress(DcpSafeError):
            decode_object(_damaged(plain, rng), "p", "o")


def test_a_zstd_stream_is_decoded_up_to_its_bound_and_no_further() -> None:
    import zstandard

    data = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    assert len(decode_transforms(data, ["stream.zstd/1"], max_bytes=1 << 20, path="p", item="i"))
    with pytest.raises(UnsafeCheckpointError, match="decompresses to more"):
        decode_transforms(data, ["stream.zstd/1"], max_bytes=(1 << 20) - 1, path="p", item="i")
    with pytest.raises(CheckpointCorruptError, match="unknown transforms"):
        decode_transforms(data, ["gzip/1"], max_bytes=None, path="p", item="i")
    with pytest.raises(CheckpointCorruptError, match="cannot decompress"):
        decode_transforms(b"not zstd", ["stream.zstd/1"], max_bytes=None, path="p", item="i")


def test_admitted_names_cannot_be_turned_against_the_process() -> None:
    """A storage class called as a constructor, a bytearray of a length: refused typed; the
    pickle opcodes that set attributes (BUILD onto an admitted class) refused before loading."""
    for pickled in (
        call_pickle(torch.FloatStorage, 10),
        call_pickle(bytearray, 1 << 40),
    ):
        with pytest.raises(UnsafeCheckpointError):
            decode_object(torch_archive(pickled), "p", "o")
    build = b"\x80\x02ccollections\nOrderedDict\nN}X\x01\x00\x00\x00aK\x01s\x86b."
    with pytest.raises(UnsafeCheckpointError, match="BUILD"):
        decode_object(torch_archive(build), "p", "o")
    assert not hasattr(collections.OrderedDict, "a")
