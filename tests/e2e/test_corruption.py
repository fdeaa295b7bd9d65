"""Damaged checkpoints: every damaged byte is detected, and the error says where.

A committed checkpoint (mixed dtypes, a bf16 tensor, a nested Python object, a few hundred KB;
uncompressed and zstd) is copied and damaged in one way per case: a flipped byte anywhere in any
of its files, a truncated, deleted or swapped shard, a damaged manifest, a missing ``.metadata``.
``verify_checkpoint`` must reject every one with ``CheckpointCorruptError`` naming the file, and
loading must either reject it the same way or, only when the damage is in a file loading never
reads (the rank manifest), return the original values bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _crash import assert_bit_exact, blank_like, make_values, record_figures

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    SafeStorageReader,
    SafeStorageWriter,
    WriterOptions,
    layout,
)
from dcp_safe.manifest.checksum import digest_bytes
from dcp_safe.manifest.schema import Manifest, manifest_digest

NAME = "step_000100"
FLIPS_PER_VARIANT = 200
SCALE = 100  # make_values(seed, scale=100) is about 220 KB of tensors
RANK_MANIFEST = layout.rank_manifest_name(0)


@dataclass(frozen=True)
class Pristine:
    """A committed checkpoint to copy from, and the values it holds."""

    root: Path
    values: dict[str, Any]

    @property
    def files(self) -> list[str]:
        base = self.root / NAME
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())

    def copy(self, dest: Path) -> Path:
        """A fresh root holding a copy of the checkpoint."""
        shutil.copytree(self.root, dest)
        return dest


def _commit(root: Path, **kwargs: Any) -> Pristine:
    values = make_values(7, scale=SCALE)
    dcp_safe.save(
        values,
        checkpoint_id=NAME,
        storage_writer=SafeStorageWriter(root, **kwargs),
        no_dist=True,
    )
    return Pristine(root, values)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pristine]:
    """The templates: uncompressed, zstd, and uncompressed in two shard files."""
    return {
        "none": _commit(tmp_path_factory.mktemp("none")),
        "zstd": _commit(tmp_path_factory.mktemp("zstd"), options=WriterOptions(compression="zstd")),
        "two_shards": _commit(
            tmp_path_factory.mktemp("two"), options=WriterOptions(thread_count=2)
        ),
    }


def _load(root: Path, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    dcp_safe.load(target, checkpoint_id=NAME, storage_reader=SafeStorageReader(root), no_dist=True)
    return target


def _verify_error(root: Path) -> CheckpointCorruptError:
    with pytest.raises(CheckpointCorruptError) as info:
        dcp_safe.verify_checkpoint(root, NAME)
    return info.value


def _load_error(root: Path, like: dict[str, Any]) -> CheckpointCorruptError:
    with pytest.raises(CheckpointCorruptError) as info:
        _load(root, like)
    return info.value


def _flip_plan(files: dict[str, int], count: int, seed: int) -> list[tuple[str, int, int]]:
    """(file, offset, xor mask): the first and last byte of every file, then seeded random
    offsets dealt to the files in turn, so every file gets its share whatever its size."""
    rng = random.Random(seed)
    plan = [(f, off, rng.randrange(1, 256)) for f, size in files.items() for off in (0, size - 1)]
    names = sorted(files)
    while len(plan) < count:
        name = names[len(plan) % len(names)]
        plan.append((name, rng.randrange(files[name]), rng.randrange(1, 256)))
    return plan


def _flip(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


# --------------------------------------------------------------------------- single-byte flips


LONG_ONLY = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DCP_SAFE_LONG") != "1", reason="set DCP_SAFE_LONG=1"),
]


@pytest.mark.parametrize(
    ("variant", "flips"),
    [
        ("none", 200),
        ("zstd", 100),
        pytest.param("none", 2000, marks=LONG_ONLY, id="none-long"),
        pytest.param("zstd", 1000, marks=LONG_ONLY, id="zstd-long"),
        pytest.param("two_shards", 1000, marks=LONG_ONLY, id="two_shards-long"),
    ],
)
def test_every_single_byte_flip_is_detected(
    pristine: dict[str, Pristine], tmp_path: Path, variant: str, flips: int
) -> None:
    template = pristine[variant]
    # One working copy; each flip is undone (a second XOR) before the next one.
    root = template.copy(tmp_path / "root")
    base = root / NAME
    sizes = {f: (base / f).stat().st_size for f in template.files}
    assert set(sizes) >= {
        "__0_0.distcp",
        layout.DCP_METADATA,
        layout.MANIFEST,
        layout.COMMITTED_MARKER,
        RANK_MANIFEST,
    }
    plan = _flip_plan(sizes, flips, seed={"none": 1234, "zstd": 5678}.get(variant, 91) + flips)
    missed: list[str] = []
    unnamed: list[str] = []
    load_wrong: list[str] = []
    for file, offset, mask in plan:
        where = f"{file}@{offset}^{mask:#04x}"
        _flip(base / file, offset, mask)
        try:
            dcp_safe.verify_checkpoint(root, NAME)
            missed.append(where)
        except CheckpointCorruptError as exc:
            # A damaged marker is reported as a manifest that no longer matches it.
            named = layout.MANIFEST if file == layout.COMMITTED_MARKER else file
            if not exc.path.endswith(f"{NAME}/{named}"):
                unnamed.append(f"{where}: {exc.path}")
        try:
            loaded = _load(root, template.values)
        except CheckpointCorruptError:
            pass
        else:
            # Loads read neither rank manifests nor .metadata (DCP's metadata comes from the
            # manifest's plain form; the pickle is for torch's own readers): what they load
            # must still be exact. Verification reads both.
            if file not in (RANK_MANIFEST, layout.DCP_METADATA):
                load_wrong.append(f"{where}: loaded without error")
            else:
                assert_bit_exact(loaded, template.values, where)
        _flip(base / file, offset, mask)
    record_figures(
        "flips",
        variant=variant,
        tried=len(plan),
        detected_by_verify=len(plan) - len(missed),
        unnamed=len(unnamed),
        accepted_by_load=len(load_wrong),
    )
    assert len(plan) >= flips
    assert {f for f, _, _ in plan} == set(sizes)
    assert missed == [], f"verify missed {len(missed)}/{len(plan)} flips: {missed}"
    assert unnamed == [], f"errors that do not name the damaged file: {unnamed}"
    assert load_wrong == [], f"load accepted damaged bytes: {load_wrong}"
    # Every flip was undone: the working copy is the pristine checkpoint again.
    dcp_safe.verify_checkpoint(root, NAME)
    assert_bit_exact(_load(root, template.values), template.values)


# --------------------------------------------------------------------------- whole-file damage


def test_truncated_shard_is_named_with_its_sizes(
    pristine: dict[str, Pristine], tmp_path: Path
) -> None:
    template = pristine["none"]
    root = template.copy(tmp_path / "root")
    shard = root / NAME / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    error = _verify_error(root)
    assert error.path.endswith(f"{NAME}/__0_0.distcp")
    assert (error.expected, error.actual) == (size, size // 2)
    assert _load_error(root, template.values).path.endswith(f"{NAME}/__0_0.distcp")


@pytest.mark.parametrize("cuts", [24, pytest.param(240, marks=LONG_ONLY, id="long")])
def test_every_random_truncation_of_any_file_is_detected(
    pristine: dict[str, Pristine], tmp_path: Path, cuts: int
) -> None:
    template = pristine["two_shards"]
    rng = random.Random(4321 + cuts)
    files = template.files
    missed = []
    for i in range(cuts):
        root = template.copy(tmp_path / f"root_{i}")
        name = files[i % len(files)]
        path = root / NAME / name
        keep = rng.randrange(path.stat().st_size)  # a strictly shorter file, maybe empty
        os.truncate(path, keep)
        try:
            dcp_safe.verify_checkpoint(root, NAME)
            missed.append(f"{name} cut to {keep}")
        except CheckpointCorruptError:
            pass
        # Loading never reads the rank manifest, nor .metadata (DCP's metadata comes from the
        # manifest's plain form): what it loads then must be exact.
        if name not in (RANK_MANIFEST, layout.DCP_METADATA):
            with pytest.raises(CheckpointCorruptError):
                _load(root, template.values)
        else:
            assert_bit_exact(_load(root, template.values), template.values, name)
        shutil.rmtree(root)
    record_figures("truncations", tried=cuts, detected=cuts - len(missed))
    assert missed == [], f"verify missed {len(missed)}/{cuts} truncations: {missed}"


def test_deleted_shard_is_named_as_missing(pristine: dict[str, Pristine], tmp_path: Path) -> None:
    template = pristine["two_shards"]
    root = template.copy(tmp_path / "root")
    (root / NAME / "__0_1.distcp").unlink()
    error = _verify_error(root)
    assert error.path.endswith(f"{NAME}/__0_1.distcp")
    assert "missing" in str(error)
    assert _load_error(root, template.values).path.endswith(f"{NAME}/__0_1.distcp")


def test_swapped_shard_files_are_detected(pristine: dict[str, Pristine], tmp_path: Path) -> None:
    template = pristine["two_shards"]
    root = template.copy(tmp_path / "root")
    first, second = root / NAME / "__0_0.distcp", root / NAME / "__0_1.distcp"
    assert first.exists() and second.exists()
    parked = root / NAME / "parked"
    first.rename(parked)
    second.rename(first)
    parked.rename(second)
    error = _verify_error(root)
    assert error.path.endswith(("__0_0.distcp", "__0_1.distcp"))
    assert _load_error(root, template.values).path.endswith(("__0_0.distcp", "__0_1.distcp"))


def test_swapped_equal_size_shards_fail_their_checksums(tmp_path: Path) -> None:
    # Two files of exactly the same size: only the item checksums can tell them apart.
    values = {"a": make_values(1)["w"], "b": make_values(2)["w"]}
    dcp_safe.save(
        values,
        checkpoint_id=NAME,
        storage_writer=SafeStorageWriter(tmp_path, options=WriterOptions(thread_count=2)),
        no_dist=True,
    )
    first, second = tmp_path / NAME / "__0_0.distcp", tmp_path / NAME / "__0_1.distcp"
    assert first.stat().st_size == second.stat().st_size
    first.rename(tmp_path / "parked")
    second.rename(first)
    (tmp_path / "parked").rename(second)
    error = _verify_error(tmp_path)
    assert "checksum" in str(error) and error.expected != error.actual
    assert "checksum" in str(_load_error(tmp_path, values))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda raw: raw[: len(raw) // 2], id="truncated"),
        pytest.param(lambda raw: b"", id="emptied"),
        pytest.param(lambda raw: raw.replace(b'"size":', b'"size" :', 1), id="reformatted"),
    ],
)
def test_damaged_manifest_is_named(
    pristine: dict[str, Pristine], tmp_path: Path, damage: Any
) -> None:
    template = pristine["none"]
    root = template.copy(tmp_path / "root")
    manifest = root / NAME / layout.MANIFEST
    manifest.write_bytes(damage(manifest.read_bytes()))
    assert _verify_error(root).path.endswith(f"{NAME}/{layout.MANIFEST}")
    assert _load_error(root, template.values).path.endswith(f"{NAME}/{layout.MANIFEST}")
    # Not a checkpoint anyone should pick up.
    assert dcp_safe.list_checkpoints(root) == []


def test_manifest_rewritten_with_a_matching_marker_is_still_checked_against_the_data(
    pristine: dict[str, Pristine], tmp_path: Path
) -> None:
    # The marker only proves the manifest is the one that was committed; a manifest and marker
    # rewritten together (a buggy tool, a bad restore) must still fail on the data itself.
    template = pristine["none"]
    root = template.copy(tmp_path / "root")
    base = root / NAME
    raw = (base / layout.MANIFEST).read_bytes()
    manifest = Manifest.from_json(raw, "manifest.json")
    victim = next(i for i in manifest.items if i.fqn == "bf16")
    forged = raw.replace(victim.checksum.encode(), b"xxh3_128:" + b"0" * 32)
    assert forged != raw
    (base / layout.MANIFEST).write_bytes(forged)
    (base / layout.COMMITTED_MARKER).write_bytes(manifest_digest(forged).encode())
    error = _verify_error(root)
    assert error.path.endswith(f"{NAME}/{victim.file}")
    assert error.item == victim.describe()
    assert error.expected == "xxh3_128:" + "0" * 32
    assert error.actual == victim.checksum
    assert _load_error(root, template.values).item == victim.describe()


def test_verify_rejects_a_committed_manifest_that_load_rejects(
    pristine: dict[str, Pristine], tmp_path: Path
) -> None:
    # A manifest whose marker matches but which does not list .metadata (a buggy writer, a bad
    # restore): verify refuses it. A load does not need .metadata (it decodes DCP's metadata
    # from the manifest itself) and loads exactly, so "verified" still means "loadable".
    template = pristine["none"]
    root = template.copy(tmp_path / "root")
    base = root / NAME
    manifest = json.loads((base / layout.MANIFEST).read_bytes())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != layout.DCP_METADATA]
    forged = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    (base / layout.MANIFEST).write_bytes(forged)
    (base / layout.COMMITTED_MARKER).write_bytes(manifest_digest(forged).encode())
    assert_bit_exact(_load(root, template.values), template.values)
    assert _verify_error(root).path.endswith(f"{NAME}/{layout.MANIFEST}")


def test_missing_metadata_is_named(pristine: dict[str, Pristine], tmp_path: Path) -> None:
    template = pristine["none"]
    root = template.copy(tmp_path / "root")
    (root / NAME / layout.DCP_METADATA).unlink()
    error = _verify_error(root)
    assert error.path.endswith(f"{NAME}/{layout.DCP_METADATA}")
    assert "missing" in str(error)
    # torch's own readers need .metadata; dcp_safe's loads do not (see above).
    assert_bit_exact(_load(root, template.values), template.values)


def test_missing_rank_manifest_fails_verify_but_not_load(
    pristine: dict[str, Pristine], tmp_path: Path
) -> None:
    template = pristine["none"]
    root = template.copy(tmp_path / "root")
    (root / NAME / RANK_MANIFEST).unlink()
    assert _verify_error(root).path.endswith(f"{NAME}/{RANK_MANIFEST}")
    assert_bit_exact(_load(root, template.values), template.values)


# --------------------------------------------------------------------------- what the error says


@pytest.mark.parametrize("fqn", ["bf16", "extra.history.1.lr"])
@pytest.mark.parametrize("variant", ["none", "zstd"])
def test_error_names_file_item_and_both_checksums(
    pristine: dict[str, Pristine], tmp_path: Path, fqn: str, variant: str
) -> None:
    template = pristine[variant]
    root = template.copy(tmp_path / "root")
    raw = (root / NAME / layout.MANIFEST).read_bytes()
    item = next(i for i in Manifest.from_json(raw, "manifest.json").items if i.fqn == fqn)
    shard = root / NAME / item.file
    _flip(shard, item.start + item.length // 2, 0x40)
    damaged = shard.read_bytes()[item.start : item.start + item.length]
    actual = digest_bytes(damaged, item.checksum.partition(":")[0])
    for error in (_verify_error(root), _load_error(root, template.values)):
        assert error.path.endswith(f"{NAME}/{item.file}")
        assert error.item == item.describe()
        assert (error.expected, error.actual) == (item.checksum, actual)
        assert error.expected != error.actual
        message = str(error)
        assert item.file in message and item.checksum in message and actual in message
