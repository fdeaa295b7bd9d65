"""DCP's metadata as plain JSON in the manifest: it round-trips exactly, and the decoder takes
nothing on trust (types, bounds, every chunk an item of the manifest)."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_state, resign_manifest

import dcp_safe
from dcp_safe import SafeStorageWriter, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.metadata import decode_pickled_metadata
from dcp_safe.cli import main as cli_main
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.dcp_metadata import decode_dcp_metadata, encode_dcp_metadata
from dcp_safe.manifest.schema import Manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest, Any]:
    """A checkpoint of tensors, plain objects and a BytesIO (with fingerprints), its manifest
    and its unpickled .metadata (this test trusts what it wrote itself)."""
    root = tmp_path_factory.mktemp("plain") / "root"
    state = make_state(3)
    state["blob"] = io.BytesIO(b"opaque")
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    manifest = open_committed(open_backend(str(root)), "step_1").manifest
    pickled = pickle.loads((root / "step_1" / layout.DCP_METADATA).read_bytes())
    return root, manifest, pickled


def test_the_plain_form_decodes_to_exactly_what_dcp_pickled(saved: Any) -> None:
    root, manifest, pickled = saved
    assert manifest.dcp_metadata is not None
    decoded = decode_dcp_metadata(manifest.dcp_metadata, manifest, "m")
    assert decoded.state_dict_metadata == pickled.state_dict_metadata
    assert list(decoded.state_dict_metadata) == list(pickled.state_dict_metadata)  # DCP's order
    assert decoded.planner_data == pickled.planner_data
    assert layout.AUDIT_KEY in decoded.planner_data  # the fingerprints came through
    assert decoded.storage_data == pickled.storage_data
    assert decoded.storage_meta.checkpoint_id == pickled.storage_meta.checkpoint_id
    assert decoded.storage_meta.save_id == pickled.storage_meta.save_id
    assert decoded.version == pickled.version
    # And the unpickled form encodes to the very same plain form, as the pickle walks to it.
    assert encode_dcp_metadata(pickled) == manifest.dcp_metadata
    raw = (root / "step_1" / layout.DCP_METADATA).read_bytes()
    plain, items = decode_pickled_metadata(raw, "m", allow_pickle=False, manifest=manifest)
    assert plain == manifest.dcp_metadata
    assert sorted(i.key for i in items) == sorted(i.key for i in manifest.items)


def test_a_repeated_layout_reuses_its_entries_and_a_new_one_is_encoded_afresh(saved: Any) -> None:
    _, _, pickled = saved
    first = encode_dcp_metadata(pickled)
    again = encode_dcp_metadata(dataclasses.replace(pickled))  # a cached plan's metadata
    assert again == first
    assert again["entries"][0] is first["entries"][0]  # not encoded twice
    assert again["entries"] is not first["entries"]  # each caller's own list
    other = copy.deepcopy(pickled)  # an equal layout in another dict: encoded again
    fresh = encode_dcp_metadata(other)
    assert fresh == first and fresh["entries"][0] is not first["entries"][0]
    walked = decode_pickled_metadata(pickle.dumps(other), "m", allow_pickle=True)[0]
    assert walked == first and walked["entries"][0] is not fresh["entries"][0]  # not the memo


def _broken(manifest: Manifest, edit: Any) -> dict[str, Any]:
    raw = copy.deepcopy(dict(manifest.dcp_metadata or {}))
    edit(raw)
    return raw


def _tensor(raw: dict[str, Any], key: str) -> dict[str, Any]:
    return next(body for k, body in raw["entries"] if k == key)


def _set(path: list[Any], value: Any) -> Any:
    """An edit that sets ``path`` (from the top, or from tensor entry "f32") to ``value``."""

    def edit(raw: dict[str, Any]) -> None:
        target: Any = _tensor(raw, "f32") if path[0] == "f32" else raw
        for step in path[1:-1] if path[0] == "f32" else path[:-1]:
            target = target[step]
        target[path[-1]] = value

    return edit


def _fingerprint(value: Any) -> Any:
    def edit(raw: dict[str, Any]) -> None:
        entry = next(e for e in raw["planner_data"]["audit"] if e[1])
        entry[1] = value

    return edit


BROKEN = {
    "not_an_object": lambda raw: raw.clear(),
    "unknown_version": _set(["version"], 2),
    "unknown_format": _set(["format"], "pickle"),
    "entries_not_a_list": _set(["entries"], {"f32": None}),
    "size_a_string": _set(["f32", "size"], "16x8"),
    "size_a_bool": _set(["f32", "size"], [True, 8]),
    "size_negative": _set(["f32", "size"], [-16, 8]),
    "size_huge": _set(["f32", "size"], [10**30, 8]),
    "sixty_five_dims": _set(["f32", "size"], [1] * 65),
    "dtype_unknown": _set(["f32", "dtype"], "float99"),
    "dtype_not_a_name": _set(["f32", "dtype"], ["float32"]),
    "layout_unknown": _set(["f32", "layout"], "jagged-ish"),
    "requires_grad_a_string": _set(["f32", "requires_grad"], "no"),
    "extra_field": _set(["f32", "stride"], [8, 1]),
    "chunk_outside_tensor": _set(["f32", "chunks"], [[[8, 0], [16, 8]]]),
    "chunk_without_item": _set(["f32", "chunks"], [[[0, 0], [16, 8]], [[16, 0], [0, 8]]]),
    "chunk_twice": _set(["f32", "chunks"], [[[0, 0], [16, 8]], [[0, 0], [16, 8]]]),
    "chunk_larger_than_its_bytes": lambda raw: _tensor(raw, "f32").update(
        size=[16, 10**9], chunks=[[[0, 0], [16, 10**9]]]
    ),
    "key_twice": lambda raw: raw["entries"].append(raw["entries"][0]),
    "object_without_item": lambda raw: raw["entries"].append(["nowhere", None]),
    "planner_path_not_a_list": lambda raw: raw["planner_data"]["paths"][0].__setitem__(1, "f32"),
    "planner_path_float": lambda raw: raw["planner_data"]["paths"][0].__setitem__(1, [1.5]),
    "fingerprints_not_hex": _fingerprint("zz" * 8),
    "fingerprints_not_whole_blocks": _fingerprint("00" * 7),
    "fingerprints_a_list": _fingerprint([1, 2]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_plain_form_is_corrupt_and_named(saved: Any, case: str) -> None:
    _, manifest, _ = saved
    raw = _broken(manifest, BROKEN[case])
    with pytest.raises(CheckpointCorruptError, match="malformed DCP metadata") as caught:
        decode_dcp_metadata(raw, manifest, "manifest.json")
    assert caught.value.path == "manifest.json"


def test_element_counts_are_checked_against_the_items_bytes_before_multiplying(
    saved: Any,
) -> None:
    """Sizes of 2**62: refused at the first dimension, against the item's 2 KiB."""
    _, manifest, _ = saved

    def edit(raw: dict[str, Any]) -> None:
        body = _tensor(raw, "f32")
        body["size"] = [1 << 62, 1 << 62]
        body["chunks"] = [[[0, 0], [1 << 62, 1 << 62]]]

    with pytest.raises(CheckpointCorruptError, match=r"larger than its .* stored bytes"):
        decode_dcp_metadata(_broken(manifest, edit), manifest, "m")


def test_a_tensor_declared_larger_than_its_chunks_is_refused_by_verify_and_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """f32 declared 2**62 rows over its one real chunk (re-signed as a root writer can): was
    "OK" from deep verify and a 2**37 GiB tensor in ``inspect``."""
    root = tmp_path / "root"
    dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))

    def edit(raw: dict[str, Any]) -> None:
        body = _tensor(raw["dcp_metadata"], "f32")
        body["size"] = [1 << 62, body["size"][1]]

    resign_manifest(root, "step_1", edit)
    with pytest.raises(CheckpointCorruptError, match=r"tensor f32 declares .* chunk\(s\) hold"):
        dcp_safe.verify_checkpoint(root, "step_1", deep=True)
    capsys.readouterr()
    assert cli_main(["inspect", str(root), "step_1"]) == 1
    assert "tensor f32 declares" in capsys.readouterr().err


def test_pickled_storage_data_must_name_the_manifests_own_files_and_bytes(saved: Any) -> None:
    _, manifest, pickled = saved

    def walk(storage: dict[Any, Any]) -> Any:
        raw = pickle.dumps(dataclasses.replace(pickled, storage_data=storage))
        return decode_pickled_metadata(raw, "m", allow_pickle=True, manifest=manifest)

    _, items = walk(pickled.storage_data)  # as written: agrees, and names the manifest's items
    assert all(manifest.item(item.key) is item for item in items)
    moved = {
        index: dataclasses.replace(info, relative_path="../step_0/__0_0.distcp")
        for index, info in pickled.storage_data.items()
    }
    with pytest.raises(CheckpointCorruptError, match="disagrees with the manifest"):
        walk(moved)
    shifted = {
        index: dataclasses.replace(info, offset=info.offset + 1)
        for index, info in pickled.storage_data.items()
    }
    with pytest.raises(CheckpointCorruptError, match="disagrees with the manifest"):
        walk(shifted)


def test_a_shared_chunk_list_is_refused_by_the_budget_not_walked(saved: Any) -> None:
    """A pickled metadata can share one list of chunks under every key; walking it costs the
    pickle's size, not the product of the two."""
    _, _, pickled = saved
    entry = pickled.state_dict_metadata["f32"]
    shared = entry.chunks * 10_000
    metadata = copy.copy(pickled)
    metadata.state_dict_metadata = {
        f"k{i}": dataclasses.replace(entry, chunks=shared) for i in range(10_000)
    }
    with pytest.raises(CheckpointCorruptError, match="more elements than its bytes hold"):
        decode_pickled_metadata(pickle.dumps(metadata), "m", allow_pickle=True)


def test_custom_planner_data_has_no_plain_form(saved: Any) -> None:
    _, _, pickled = saved
    odd = copy.copy(pickled)
    odd.planner_data = {"my_planner": {"state": torch.ones(1)}}
    with pytest.raises(ValueError):
        encode_dcp_metadata(odd)
    with pytest.raises(CheckpointCorruptError, match="flatten paths"):
        decode_pickled_metadata(pickle.dumps(odd), "m", allow_pickle=True)


def test_fingerprint_blocks_summed_from_several_ranks_encode_in_block_order(saved: Any) -> None:
    """Ranks' partials arrive in any order (rank 1's later blocks may come first): the plain form
    sorts them, and a set of blocks with a gap is still refused."""
    _, manifest, pickled = saved
    audit = pickled.planner_data[layout.AUDIT_KEY]
    key = next(k for k, blocks in audit.items() if len(blocks) > 1)
    shuffled = copy.copy(pickled)
    shuffled.planner_data = dict(pickled.planner_data)
    shuffled.planner_data[layout.AUDIT_KEY] = {
        **audit,
        key: dict(reversed(list(audit[key].items()))),
    }
    assert encode_dcp_metadata(shuffled) == manifest.dcp_metadata
    gap = dict(audit[key])
    del gap[0]
    shuffled.planner_data[layout.AUDIT_KEY] = {**audit, key: gap}
    with pytest.raises(ValueError, match="blocks 0, 1"):
        encode_dcp_metadata(shuffled)
