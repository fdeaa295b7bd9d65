"""Manifests: canonical JSON that round-trips, and damaged documents are named corrupt."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.schema import (
    FileRecord,
    ItemRecord,
    Manifest,
    RankManifest,
    item_key,
    manifest_digest,
)

_items = st.builds(
    ItemRecord,
    fqn=st.text(min_size=1, max_size=20),
    offset=st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(0, 10**9))),
    file=st.just("__0_0.distcp"),
    start=st.integers(0, 10**12),
    length=st.integers(0, 10**12),
    checksum=st.builds(
        "{}:{}".format,
        st.sampled_from([a.value for a in ChecksumAlgorithm]),
        st.text("0123456789abcdef", min_size=1, max_size=32),
    ),
    transforms=st.one_of(st.just(()), st.just(("stream.zstd/1",))),
)


def _manifest(items: tuple[ItemRecord, ...]) -> Manifest:
    return Manifest(
        name="step_1",
        save_id="abc",
        world_size=2,
        created_at=1.5,
        checksum_algorithm="xxh3_128",
        compression="none",
        files=(FileRecord(path="__0_0.distcp", size=10),),
        items=items,
        dcp_safe_version="0.1.0",
        torch_version="2.13.0",
        step=1,
    )


@given(st.lists(_items, max_size=5).map(tuple))
def test_manifest_round_trips_through_canonical_json(items: tuple[ItemRecord, ...]) -> None:
    manifest = _manifest(items)
    data = manifest.to_json()
    again = Manifest.from_json(data, "m")
    assert again == manifest
    assert again.to_json() == data
    assert manifest_digest(data) == manifest_digest(again.to_json())


def test_rank_manifest_round_trips() -> None:
    rank = RankManifest(
        name="s",
        save_id="x",
        rank=3,
        checksum_algorithm="sha256",
        files=(FileRecord(path="a", size=1),),
        items=(),
    )
    assert RankManifest.from_json(rank.to_json(), "r") == rank


def test_items_are_found_by_dcp_index() -> None:
    item = ItemRecord(fqn="w", offset=(4, 0), file="f", start=0, length=1, checksum="crc32:0")
    assert _manifest((item,)).item(item_key("w", [4, 0])) == item
    assert _manifest((item,)).item(item_key("w", None)) is None


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"format": "other"}',
        b'{"format":"dcp_safe/manifest","version":99}',
    ],
)
def test_damaged_manifests_are_corrupt(data: bytes) -> None:
    with pytest.raises(CheckpointCorruptError):
        Manifest.from_json(data, "m")


def test_a_manifest_with_missing_fields_is_corrupt() -> None:
    with pytest.raises(CheckpointCorruptError):
        Manifest.from_json(b'{"format":"dcp_safe/manifest","version":1,"files":[],"items":[]}', "m")


@pytest.mark.parametrize(
    "path",
    ["../../outside", "/etc/passwd", "a/b/c", "..", "_ranks/../x", "", "x\\..\\y", 7],
)
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_corrupt(path: object) -> None:
    """Every path is used under the checkpoint's folder (verify reads it, replication writes
    and deletes it), so a manifest may only name the layout's own files."""
    raw = _manifest(()).to_json().replace(b'"path":"__0_0.distcp"', b'"path":' + _json(path))
    with pytest.raises(CheckpointCorruptError, match=r"not a file of the checkpoint|malformed"):
        Manifest.from_json(raw, "manifest.json")


@pytest.mark.parametrize("size", [-1, True, 1.5, "10"])
def test_a_manifest_with_a_size_that_is_no_byte_count_is_corrupt(size: object) -> None:
    raw = _manifest(()).to_json().replace(b'"size":10', b'"size":' + _json(size))
    with pytest.raises(CheckpointCorruptError, match="byte count"):
        Manifest.from_json(raw, "manifest.json")


def test_the_layouts_own_files_are_accepted() -> None:
    for path in (".metadata", "__0_0.distcp", "_ranks/rank_00000.json", "manifest.json"):
        assert FileRecord(path=path, size=1).path == path


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


# ---------------------------------------------------------------- strict fields (issue #17)


def _with(**fields: object) -> bytes:
    """A valid manifest's JSON with ``fields`` replaced (raw JSON values, as a writer can)."""
    raw = json.loads(_manifest(()).to_json())
    raw.update(fields)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"created_at": "yesterday"}, "created_at must be a time"),
        ({"created_at": -1}, "created_at must be a time"),
        ({"created_at": 1e300}, "created_at must be a time"),
        ({"created_at": True}, "created_at must be a time"),
        ({"step": "2"}, "step must be an integer"),
        ({"step": 2**64}, "step must be an integer"),
        ({"world_size": 0}, "world_size must be an integer"),
        ({"name": 7}, "name must be a string"),
        ({"checksum_algorithm": "md5"}, "md5"),
        ({"items": {"a": 1}}, "items must be a list"),
        ({"files": "abc"}, "files must be a list"),
        ({"files": [1, 2]}, "files must be a list of objects"),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_corrupt(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(CheckpointCorruptError, match=message):
        Manifest.from_json(_with(**fields), "manifest.json")


@pytest.mark.parametrize(
    "text",
    [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1" + b"0" * 5000],
)
def test_non_finite_and_oversized_numbers_are_corrupt(text: bytes) -> None:
    raw = _manifest(()).to_json().replace(b'"created_at":1.5', b'"created_at":' + text)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        Manifest.from_json(raw, "manifest.json")


def test_deeply_nested_json_is_corrupt_not_a_recursion_error() -> None:
    with pytest.raises(CheckpointCorruptError, match="nested too deeply"):
        Manifest.from_json(b"[" * 200_000 + b"]" * 200_000, "manifest.json")
    with pytest.raises(CheckpointCorruptError, match="nested too deeply"):
        RankManifest.from_json(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "rank.json")


def _item(**fields: object) -> dict[str, object]:
    item: dict[str, object] = {
        "fqn": "w",
        "offset": None,
        "file": "__0_0.distcp",
        "start": 0,
        "length": 10,
        "checksum": "crc32:0",
        "transforms": [],
    }
    return item | fields


@pytest.mark.parametrize("checksum", ["md5:" + "0" * 32, "xxh3_128:", "", 7, "sha256"])
def test_an_item_checksum_of_an_unknown_algorithm_is_corrupt(checksum: object) -> None:
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(_with(items=[_item(checksum=checksum)]), "manifest.json")


@pytest.mark.parametrize("offset", ["ab", [1.5], [-1], {"a": 1}])
def test_an_item_offset_that_is_not_a_list_of_indices_is_corrupt(offset: object) -> None:
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(_with(items=[_item(offset=offset)]), "manifest.json")


def test_a_well_formed_item_passes() -> None:
    assert Manifest.from_json(_with(items=[_item()]), "manifest.json").items[0].fqn == "w"


# ---------------------------------------------------------------- explicit to_dict (issue #18)


def _reference_json(manifest: Manifest | RankManifest, kind: str) -> bytes:
    """The JSON that ``dataclasses.asdict`` gave before records had their own ``to_dict``
    (a manifest without plain DCP metadata leaves that field out, an item without block digests
    likewise: the JSON is as before them)."""
    raw = {
        f.name: getattr(manifest, f.name)
        for f in dataclasses.fields(manifest)
        if not f.name.startswith("_")
        and not (
            f.name in ("dcp_metadata", "data_format", "metrics")
            and getattr(manifest, f.name) is None
        )
    }
    raw["files"] = [dataclasses.asdict(f) for f in manifest.files]
    raw["items"] = [
        {k: v for k, v in dataclasses.asdict(i).items() if k != "blocks"}
        | {"offset": None if i.offset is None else list(i.offset), "transforms": list(i.transforms)}
        | ({} if i.blocks is None else {"blocks": i.blocks.to_dict()})
        for i in manifest.items
    ]
    raw["format"] = kind
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


@given(st.lists(_items, max_size=5).map(tuple))
def test_to_json_is_byte_for_byte_what_asdict_gave(items: tuple[ItemRecord, ...]) -> None:
    manifest = _manifest(items)
    assert manifest.to_json() == _reference_json(manifest, "dcp_safe/manifest")
    rank = RankManifest(
        name="s",
        save_id="x",
        rank=1,
        checksum_algorithm="crc32",
        files=(FileRecord(path="__1_0.distcp", size=3, checksum=None),),
        items=items,
    )
    assert rank.to_json() == _reference_json(rank, "dcp_safe/rank-manifest")


@pytest.mark.parametrize(
    "item",
    [
        {k: v for k, v in _item().items() if k != "transforms"},
        {k: v for k, v in _item().items() if k != "offset"},
        _item(extra=1),
    ],
)
def test_an_item_with_a_missing_or_unknown_key_is_corrupt(item: dict[str, object]) -> None:
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(_with(items=[item]), "manifest.json")


def test_a_file_record_may_leave_out_its_checksum_but_not_add_keys() -> None:
    files = [{"path": "__0_0.distcp", "size": 10}]
    assert Manifest.from_json(_with(files=files), "m").files[0].checksum is None
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(_with(files=[files[0] | {"mode": 1}]), "m")


def test_the_derived_lookup_tables_are_never_read_from_storage() -> None:
    with pytest.raises(CheckpointCorruptError, match="unknown fields"):
        Manifest.from_json(_with(_by_path={}), "manifest.json")


def test_files_are_found_by_path() -> None:
    manifest = _manifest(())
    assert manifest.file("__0_0.distcp") == FileRecord(path="__0_0.distcp", size=10)
    assert manifest.file("missing") is None


@given(_items)
def test_an_item_read_back_equals_the_item_written(item: ItemRecord) -> None:
    # Plain JSON takes the fast path, which must build exactly what the dataclass init does.
    raw = json.loads(json.dumps(item.to_dict()))
    again = ItemRecord.from_dict(raw)
    assert again == item and hash(again) == hash(item)
    assert again.offset is None or type(again.offset) is tuple
    assert type(again.transforms) is tuple
    assert dataclasses.asdict(again) == dataclasses.asdict(item)
