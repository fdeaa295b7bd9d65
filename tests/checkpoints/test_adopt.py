"""``dcp_safe.adopt`` on stock checkpoints written by plain ``dcp.save`` and ``FileSystemWriter``
(one process): what it refuses and reports, what it cannot tell, and adoption in place.

The multi-rank adoption (local and S3, restored on 1, 2 and 4 ranks) is in
``test_adopt_multirank.py``.
"""

from __future__ import annotations

import datetime
import fractions
import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import dcp_safe
from dcp_safe import Root, SafeStorageReader, layout, list_checkpoints, verify_checkpoint
from dcp_safe.backends.roots import open_backend
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    PickledClassesError,
)
from dcp_safe.testing.s3_proxy import FaultProxy
from dcp_safe.torch_compat import ZStandard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WEIGHTS = torch.arange(48.0).reshape(6, 8)


def _stock(folder: Path, **extra: Any) -> Path:
    state = {"w": WEIGHTS.clone(), "step": 7, "train": io.BytesIO(b"epoch=3"), **extra}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))
    return folder


def _load(root: Path, name: str, **reader: Any) -> dict[str, Any]:
    target = {"w": torch.zeros(6, 8), "step": 0, "train": io.BytesIO()}
    dcp.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root, **reader))
    return target


def _shard(folder: Path) -> Path:
    [shard] = folder.glob("*.distcp")
    return shard


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_ino)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_an_adopted_copy_lists_verifies_and_loads(tmp_path: Path) -> None:
    source = _stock(tmp_path / "old" / "step_000100")
    before = _snapshot(source)
    report = dcp_safe.adopt(source, tmp_path / "root")
    assert (report.name, report.copied, report.world_size, report.items) == (
        "step_000100",
        True,
        1,
        3,
    )
    assert [c.name for c in list_checkpoints(tmp_path / "root")] == ["step_000100"]
    assert verify_checkpoint(tmp_path / "root", "latest").items_checked == 3
    loaded = _load(tmp_path / "root", "latest")
    assert torch.equal(loaded["w"], WEIGHTS) and loaded["step"] == 7
    assert loaded["train"].getvalue() == b"epoch=3"
    assert _snapshot(source) == before  # the source is left as it was
    with pytest.raises(CheckpointExistsError):
        dcp_safe.adopt(source, tmp_path / "root")
    with pytest.raises(CheckpointExistsError, match="committed checkpoint already"):
        dcp_safe.adopt(tmp_path / "root" / "step_000100", tmp_path / "other")


def test_classes_a_checkpoint_needs_are_named_and_adopted_only_with_allow_pickle(
    tmp_path: Path,
) -> None:
    source = _stock(tmp_path / "ck", when=datetime.date(2024, 1, 2), part=fractions.Fraction(1, 3))
    with pytest.raises(PickledClassesError) as refused:
        dcp_safe.adopt(source, tmp_path / "root")
    assert refused.value.classes == ("datetime.date", "fractions.Fraction")
    assert "datetime.date, fractions.Fraction" in str(refused.value)
    assert list_checkpoints(tmp_path / "root") == []

    dcp_safe.adopt(source, tmp_path / "root", allow_pickle=True)
    target = {"w": torch.zeros(6, 8), "when": None, "part": None}
    reader = SafeStorageReader(tmp_path / "root", allow_pickle=True)
    dcp.load(target, checkpoint_id="ck", storage_reader=reader)
    assert target["when"] == datetime.date(2024, 1, 2) and target["part"] == fractions.Fraction(
        1, 3
    )


class _Planted:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.flag,))


def test_metadata_that_would_run_code_is_refused_without_running_it(tmp_path: Path) -> None:
    source = _stock(tmp_path / "ck")
    flag = tmp_path / "ran"
    (source / layout.DCP_METADATA).write_bytes(pickle.dumps({"x": _Planted(flag)}))
    with pytest.raises(PickledClassesError) as refused:
        dcp_safe.adopt(source, tmp_path / "root")
    assert refused.value.classes == ("pathlib.Path.touch",)
    assert not flag.exists()


def test_metadata_sharing_one_long_list_under_many_keys_is_refused(tmp_path: Path) -> None:
    """A pickle's memo lets one list of chunks stand under every key: a few hundred KiB that a
    naive walk would visit a million times over. The walk counts against the pickle's size."""
    source = _stock(tmp_path / "ck")
    metadata = pickle.loads((source / layout.DCP_METADATA).read_bytes())  # our own, trusted
    entry = metadata.state_dict_metadata["w"]
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 1]))] * 5000
    metadata.state_dict_metadata = {f"k{n}": entry for n in range(2000)}
    (source / layout.DCP_METADATA).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointCorruptError, match="shared lists"):
        dcp_safe.adopt(source, tmp_path / "root")


def test_a_truncated_file_is_named_with_its_item_and_offsets(tmp_path: Path) -> None:
    source = _stock(tmp_path / "ck")
    shard = _shard(source)
    size = shard.stat().st_size
    os.truncate(shard, size - 1)
    with pytest.raises(CheckpointCorruptError) as found:
        dcp_safe.adopt(source, tmp_path / "root")
    error = found.value
    assert error.path == str(shard) and error.item is not None
    assert (error.expected, error.actual) == (size, size - 1)
    assert f"..{size}" in str(error) and "truncated" in str(error)
    assert list_checkpoints(tmp_path / "root") == []


def test_bytes_past_the_last_item_are_reported(tmp_path: Path) -> None:
    source = _stock(tmp_path / "ck")
    with _shard(source).open("ab") as file:
        file.write(b"\0")
    with pytest.raises(CheckpointCorruptError, match="longer than its items"):
        dcp_safe.adopt(source, tmp_path / "root")


def test_a_damaged_tensor_archive_is_reported(tmp_path: Path) -> None:
    source = _stock(tmp_path / "ck")
    shard = _shard(source)
    data = bytearray(shard.read_bytes())
    at = data.index(b"data.pkl")  # the tensor item's pickle record, by its name
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as found:
        dcp_safe.adopt(source, tmp_path / "root")
    assert found.value.path == str(shard) and found.value.item is not None
    assert list_checkpoints(tmp_path / "root") == []


def test_a_flipped_byte_inside_tensor_data_cannot_be_detected_and_the_report_says_so(
    tmp_path: Path,
) -> None:
    """The honest limit: DCP stores no checksums, so the numbers themselves are taken as they
    are. Adoption checksums them, so any later change is caught."""
    source = _stock(tmp_path / "ck")
    shard = _shard(source)
    data = bytearray(shard.read_bytes())
    at = data.index(WEIGHTS.numpy().tobytes())
    data[at + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    report = dcp_safe.adopt(source, tmp_path / "root")
    assert any("no checksums" in line for line in report.unchecked)
    verify_checkpoint(tmp_path / "root", "ck")
    assert not torch.equal(_load(tmp_path / "root", "ck")["w"], WEIGHTS)

    adopted = tmp_path / "root" / "ck" / shard.name
    later = bytearray(adopted.read_bytes())
    later[at + 5] ^= 0x01
    adopted.write_bytes(bytes(later))
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        verify_checkpoint(tmp_path / "root", "ck")


def test_in_place_adoption_keeps_the_files_where_they_are(tmp_path: Path) -> None:
    source = _stock(tmp_path / "run" / "step_000100")
    before = _snapshot(source)
    with pytest.raises(ConfigError, match="parent"):
        dcp_safe.adopt(source, tmp_path / "elsewhere", copy=False)
    with pytest.raises(ConfigError, match="parent"):
        dcp_safe.adopt(source, tmp_path / "run", "step_000200", copy=False)
    with pytest.raises(ConfigError, match="in place"):  # a copy onto itself
        dcp_safe.adopt(source, tmp_path / "run")
    assert _snapshot(source) == before

    report = dcp_safe.adopt(source, tmp_path / "run", copy=False)
    assert (report.copied, report.path) == (False, str(source))
    after = _snapshot(source)
    assert {k: v for k, v in after.items() if k in before} == before  # same bytes, same inodes
    assert set(after) - set(before) == {
        layout.MANIFEST,
        layout.COMMITTED_MARKER,
        layout.rank_manifest_name(0),
    }
    verify_checkpoint(tmp_path / "run", "step_000100")
    assert torch.equal(_load(tmp_path / "run", "latest")["w"], WEIGHTS)


def test_a_failed_in_place_adoption_leaves_the_source_as_it_was(tmp_path: Path) -> None:
    source = _stock(tmp_path / "run" / "ck", when=datetime.date(2024, 1, 2))
    before, entries = _snapshot(source), sorted(os.listdir(source))
    with pytest.raises(PickledClassesError):  # found after every byte was read
        dcp_safe.adopt(source, tmp_path / "run", copy=False)
    assert _snapshot(source) == before and sorted(os.listdir(source)) == entries
    assert list_checkpoints(tmp_path / "run") == []


def test_a_folder_without_dcp_metadata_is_not_found(tmp_path: Path) -> None:
    source = _stock(tmp_path / "ck")
    (source / layout.DCP_METADATA).unlink()
    with pytest.raises(CheckpointNotFoundError, match="stock DCP checkpoint to adopt"):
        dcp_safe.adopt(source, tmp_path / "root")
    shutil.rmtree(source)
    with pytest.raises(CheckpointNotFoundError):
        dcp_safe.adopt(source, tmp_path / "root")


@pytest.mark.s3
def test_in_place_on_a_store_that_ignores_conditional_writes_commits_behind_a_lease(
    tmp_path: Path, proxy: FaultProxy, s3_root: str
) -> None:
    """Where the marker cannot be created exclusively, the commit's per-save lease keeps a
    second adopter out: one commit, no lease left, and the name is then taken."""
    proxy.strip_header("If-None-Match", method="PUT")
    options = proxy.storage_options()
    root = Root(s3_root, options)
    assert not open_backend(root).supports_exclusive_create
    source = _stock(tmp_path / "ck")
    fsspec.filesystem("s3", **options).put(str(source), f"{s3_root[5:]}/ck", recursive=True)
    report = dcp_safe.adopt(Root(f"{s3_root}/ck", options), root, copy=False)
    assert report.copied is False
    assert [c.name for c in list_checkpoints(root)] == ["ck"]
    verify_checkpoint(root, "ck")
    assert not [e for e in open_backend(root).list_dir("ck") if layout.is_lease_file(e)]
    with pytest.raises(CheckpointExistsError):
        dcp_safe.adopt(Root(f"{s3_root}/ck", options), root, copy=False)


def test_a_checkpoint_dcp_compressed_with_zstd_is_adopted_and_loads(tmp_path: Path) -> None:
    state = {"w": WEIGHTS.clone(), "step": 7, "train": io.BytesIO(b"epoch=3")}
    writer = dcp.FileSystemWriter(str(tmp_path / "ck"), _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer)
    dcp_safe.adopt(tmp_path / "ck", tmp_path / "root")
    assert verify_checkpoint(tmp_path / "root", "ck").items_checked == 3
    loaded = _load(tmp_path / "root", "ck")
    assert torch.equal(loaded["w"], WEIGHTS) and loaded["train"].getvalue() == b"epoch=3"


def test_classes_a_compressed_object_needs_are_named_too(tmp_path: Path) -> None:
    state = {"w": WEIGHTS.clone(), "when": datetime.date(2024, 1, 2)}
    writer = dcp.FileSystemWriter(str(tmp_path / "ck"), _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer)
    with pytest.raises(PickledClassesError) as refused:
        dcp_safe.adopt(tmp_path / "ck", tmp_path / "root")
    assert refused.value.classes == ("datetime.date",)
    assert list_checkpoints(tmp_path / "root") == []
