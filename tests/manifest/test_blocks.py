"""Block digests: hashed in one pass as bytes go past, recorded in the item, strictly decoded,
and checked by full verification."""

from __future__ import annotations

import io
import json

import pytest
import xxhash

from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.blocks import BlockDigests, BlockHasher
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest
from dcp_safe.manifest.streams import HashingSink
from dcp_safe.manifest.verify import check_stream

BLOCK = 4096


def _digests(data: bytes) -> tuple[str, ...]:
    return tuple(
        xxhash.xxh3_128(data[at : at + BLOCK]).hexdigest() for at in range(0, len(data), BLOCK)
    )


def _record(data_at: int, payload: bytes, *, digests: tuple[str, ...] | None = None) -> ItemRecord:
    item = b"H" * data_at + payload + b"T" * 5
    return ItemRecord(
        fqn="w",
        offset=(0, 0),
        file="__0_0.distcp",
        start=0,
        length=len(item),
        checksum=f"xxh3_128:{xxhash.xxh3_128(item).hexdigest()}",
        blocks=BlockDigests(
            at=data_at,
            length=len(payload),
            block_bytes=BLOCK,
            digests=_digests(payload) if digests is None else digests,
        ),
    )


def test_a_sink_digests_the_data_blocks_in_the_same_pass_whatever_the_write_sizes() -> None:
    payload = bytes(range(256)) * 100  # 25,600 bytes: 6 full blocks and a short one
    out = io.BytesIO()
    sink = HashingSink(out, ChecksumAlgorithm.XXH3_128)
    sink.write(b"before")  # another item: not part of the next one's blocks
    sink.take_checksum()
    assert sink.take_blocks() is None  # not asked for
    sink.hash_blocks(at=3, length=len(payload), block_bytes=BLOCK)
    for piece in (b"hdr", payload[:1000], payload[1000:9000], payload[9000:], b"tail"):
        sink.write(piece)
    checksum = sink.take_checksum()
    blocks = sink.take_blocks()
    assert blocks == BlockDigests(
        at=3, length=len(payload), block_bytes=BLOCK, digests=_digests(payload)
    )
    assert checksum == "xxh3_128:" + xxhash.xxh3_128(b"hdr" + payload + b"tail").hexdigest()


def test_a_block_hasher_refuses_a_range_it_did_not_see_whole() -> None:
    hasher = BlockHasher("xxh3_128", item_start=0, at=0, length=10, block_bytes=BLOCK)
    hasher.update(0, memoryview(b"12345"))
    with pytest.raises(ValueError, match="ended before"):
        hasher.result()


def test_block_digests_round_trip_through_the_manifest_and_old_items_have_none() -> None:
    with_blocks = _record(7, b"x" * 10_000)
    without = ItemRecord(
        fqn="b", offset=None, file="__0_0.distcp", start=0, length=1, checksum="crc32:00000000"
    )
    manifest = Manifest(
        name="s",
        save_id="x",
        world_size=1,
        created_at=1.0,
        checksum_algorithm="xxh3_128",
        compression="none",
        files=(FileRecord(path="__0_0.distcp", size=10_012),),
        items=(with_blocks, without),
        dcp_safe_version="0",
        torch_version="0",
    )
    raw = manifest.to_json()
    assert Manifest.from_json(raw, "m").items == (with_blocks, without)
    items = json.loads(raw)["items"]
    assert "blocks" in items[0] and "blocks" not in items[1]  # as versions before them wrote


@pytest.mark.parametrize(
    "blocks",
    [
        {"at": 0, "bytes": BLOCK, "digests": ["ab"], "length": 2 * BLOCK},  # one digest short
        {"at": 0, "bytes": 16, "digests": ["ab"], "length": 16},  # a block size too small
        {"at": 0, "bytes": BLOCK, "digests": ["XYZ"], "length": 1},  # not hex
        {"at": -1, "bytes": BLOCK, "digests": ["ab"], "length": 1},
        {"at": 0, "bytes": BLOCK, "digests": "ab", "length": 1},
        {"at": 0, "bytes": BLOCK, "digests": ["ab"], "length": 1, "extra": 1},
        [1, 2],
    ],
)
def test_malformed_block_digests_make_the_manifest_corrupt(blocks: object) -> None:
    item = _record(0, b"x" * 10).to_dict() | {"blocks": blocks}
    raw = json.loads(
        Manifest(
            name="s",
            save_id="x",
            world_size=1,
            created_at=1.0,
            checksum_algorithm="xxh3_128",
            compression="none",
            files=(FileRecord(path="__0_0.distcp", size=15),),
            items=(),
            dcp_safe_version="0",
            torch_version="0",
        ).to_json()
    )
    raw["items"] = [item]
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(json.dumps(raw).encode(), "manifest.json")


def test_full_verification_checks_block_digests_too() -> None:
    payload = b"y" * 9_000
    good = _record(4, payload)
    data = b"H" * 4 + payload + b"T" * 5
    file = FileRecord(path="__0_0.distcp", size=len(data))
    assert check_stream(io.BytesIO(data), "f", file, [good]) == len(data)
    # Digests that do not describe the data (the item checksum does): caught, naming the block.
    digests = good.blocks.digests if good.blocks else ()
    wrong = _record(4, payload, digests=(*digests[:1], "00" * 16, *digests[2:]))
    with pytest.raises(CheckpointCorruptError, match="block 1 of the tensor data"):
        check_stream(io.BytesIO(data), "f", file, [wrong])
