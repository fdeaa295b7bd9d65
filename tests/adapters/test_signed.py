"""Signed checkpoints, end to end on real files: what a reader holding the key refuses.

The attacker can write the root but does not hold the key: they rewrite data, manifest and
marker so that every checksum matches (which a reader without a key accepts), swap items, copy
signatures between checkpoints, or strip them. A reader given the key refuses each of these,
and still loads what the key signed, from either tier of a replicated save.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    ConfigError,
    SafeStorageReader,
    SafeStorageWriter,
    WriterOptions,
    layout,
    verify_checkpoint,
)
from dcp_safe.cli import EXIT_FAILED, EXIT_OK, main
from dcp_safe.errors import SignatureError, UnsignedCheckpointError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.signing import SIGNING_KEY_ENV
from tests.support import resign_manifest

KEY = "hex:" + "5a" * 32
OTHER_KEY = "hex:" + "a5" * 32


@pytest.fixture(autouse=True)
def _no_ambient_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)


def _state() -> dict[str, Any]:
    return {
        "a": torch.arange(256, dtype=torch.float32),
        "b": torch.arange(256, dtype=torch.float32) * -1.0,
        "extra": {"epoch": 3},
    }


def _blank() -> dict[str, Any]:
    return {"a": torch.zeros(256), "b": torch.zeros(256), "extra": {"epoch": -1}}


def _save(
    root: Path,
    name: str = "step_1",
    key: str | None = KEY,
    *,
    checksum: str | None = None,
    step: int | None = None,
) -> None:
    options = WriterOptions(signing_key=key, checksum=checksum)  # type: ignore[arg-type]
    writer = SafeStorageWriter(root, step=step, options=options)
    dcp_safe.save(_state(), checkpoint_id=name, storage_writer=writer)


def _load(root: Path, name: str = "step_1", key: str | None = KEY) -> dict[str, Any]:
    target = _blank()
    reader = SafeStorageReader(root, signing_key=key)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    return target


def _manifest(root: Path, name: str = "step_1") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / name / layout.MANIFEST).read_bytes())
    return data


def test_a_signed_checkpoint_loads_with_and_without_the_key(tmp_path: Path) -> None:
    _save(tmp_path)
    assert (tmp_path / "step_1" / layout.SIGNATURE).read_bytes().startswith(b"hmac-sha256:")
    manifest = _manifest(tmp_path)
    assert manifest["checksum_algorithm"] == "blake3"
    checksums = [r["checksum"] for r in manifest["items"] + manifest["files"] if r["checksum"]]
    assert checksums and all(c.startswith("blake3:") for c in checksums)
    for key in (KEY, None):
        loaded = _load(tmp_path, key=key)
        assert torch.equal(loaded["b"], _state()["b"]) and loaded["extra"] == {"epoch": 3}
    assert verify_checkpoint(tmp_path, "step_1", signing_key=KEY).items_checked == 3
    SafeStorageReader(tmp_path, signing_key=KEY).reset("latest")


def test_a_signed_sha256_checkpoint_still_loads_and_verifies_with_the_key(tmp_path: Path) -> None:
    """Signed checkpoints written before BLAKE3 became the default (sha256 items) stay valid,
    and sha256 can still be chosen for a signed save."""
    _save(tmp_path, checksum="sha256")
    manifest = _manifest(tmp_path)
    assert manifest["checksum_algorithm"] == "sha256"
    assert all(item["checksum"].startswith("sha256:") for item in manifest["items"])
    loaded = _load(tmp_path)
    assert torch.equal(loaded["a"], _state()["a"]) and loaded["extra"] == {"epoch": 3}
    assert verify_checkpoint(tmp_path, "step_1", signing_key=KEY).items_checked == 3


def test_a_forged_manifest_with_matching_checksums_is_refused_with_the_key(
    tmp_path: Path,
) -> None:
    """New tensor values, the item checksum and the marker rewritten to match: only the
    signature, which needs the key, tells it apart."""
    _save(tmp_path)
    shard = next((tmp_path / "step_1").glob(f"*{layout.SHARD_SUFFIX}"))
    data = bytearray(shard.read_bytes())
    original = _state()["a"].numpy().tobytes()
    at = bytes(data).find(original)
    assert at >= 0
    data[at : at + len(original)] = torch.full((256,), 7.0).numpy().tobytes()
    shard.write_bytes(bytes(data))

    def rechecksum(raw: dict[str, Any]) -> None:
        for item in raw["items"]:
            if item["fqn"] == "a":
                chunk = data[item["start"] : item["start"] + item["length"]]
                item["checksum"] = digest_bytes(chunk, "blake3")

    resign_manifest(tmp_path, "step_1", rechecksum)

    assert torch.equal(_load(tmp_path, key=None)["a"], torch.full((256,), 7.0))  # the threat
    with pytest.raises(SignatureError, match="does not match the manifest") as caught:
        _load(tmp_path)
    assert not isinstance(caught.value, UnsignedCheckpointError)
    with pytest.raises(SignatureError):
        verify_checkpoint(tmp_path, "step_1", signing_key=KEY)
    with pytest.raises(SignatureError):
        SafeStorageReader(tmp_path, signing_key=KEY).reset("latest")


def test_a_manifest_edit_without_new_data_is_refused_too(tmp_path: Path) -> None:
    _save(tmp_path, step=10)
    resign_manifest(tmp_path, "step_1", lambda raw: raw.update(step=10_000))
    _load(tmp_path, key=None)
    with pytest.raises(SignatureError):
        _load(tmp_path)


def test_a_swapped_item_is_refused_by_its_checksum(tmp_path: Path) -> None:
    """Two items of the same size trade places; manifest, marker and signature untouched."""
    _save(tmp_path)
    items = {item["fqn"]: item for item in _manifest(tmp_path)["items"]}
    a, b = items["a"], items["b"]
    assert a["file"] == b["file"] and a["length"] == b["length"]
    shard = tmp_path / "step_1" / a["file"]
    data = bytearray(shard.read_bytes())
    span_a = bytes(data[a["start"] : a["start"] + a["length"]])
    span_b = bytes(data[b["start"] : b["start"] + b["length"]])
    data[a["start"] : a["start"] + a["length"]] = span_b
    data[b["start"] : b["start"] + b["length"]] = span_a
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        _load(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        verify_checkpoint(tmp_path, "step_1", signing_key=KEY)


def test_an_unsigned_checkpoint_is_refused_with_the_key(tmp_path: Path) -> None:
    _save(tmp_path, key=None)
    assert not (tmp_path / "step_1" / layout.SIGNATURE).exists()
    assert torch.equal(_load(tmp_path, key=None)["a"], _state()["a"])
    with pytest.raises(UnsignedCheckpointError, match="has no _SIGNATURE"):
        _load(tmp_path)
    with pytest.raises(UnsignedCheckpointError):
        verify_checkpoint(tmp_path, "step_1", signing_key=KEY)


def test_a_stripped_or_borrowed_signature_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, "step_1")
    _save(tmp_path, "step_2")
    signature = tmp_path / "step_2" / layout.SIGNATURE
    shutil.copyfile(tmp_path / "step_1" / layout.SIGNATURE, signature)
    with pytest.raises(SignatureError):
        _load(tmp_path, "step_2")
    signature.unlink()
    with pytest.raises(UnsignedCheckpointError):
        _load(tmp_path, "step_2")


def test_another_key_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, key=OTHER_KEY)
    with pytest.raises(SignatureError, match="same key"):
        _load(tmp_path)


def test_a_signed_checkpoint_moved_to_another_name_is_refused(tmp_path: Path) -> None:
    """Replay under another name fails: the signed manifest names its checkpoint."""
    _save(tmp_path, "step_1")
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_9")
    with pytest.raises(CheckpointCorruptError, match="names another checkpoint"):
        _load(tmp_path, "step_9")


def test_the_environment_variable_signs_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, "unsigned", key=None)
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    _save(tmp_path, "signed", key=None)
    assert (tmp_path / "signed" / layout.SIGNATURE).exists()
    _load(tmp_path, "signed", key=None)
    with pytest.raises(UnsignedCheckpointError):
        _load(tmp_path, "unsigned", key=None)


def test_writer_options_without_a_key_are_signed_by_the_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    by_default = SafeStorageWriter(tmp_path).options
    by_options = SafeStorageWriter(tmp_path, options=WriterOptions(thread_count=2)).options
    assert by_default == WriterOptions(signing_key=KEY)
    assert by_options == WriterOptions(thread_count=2, signing_key=KEY)
    assert by_options.signing_key is not None
    assert by_options.checksum is ChecksumAlgorithm.BLAKE3  # the default, so the signed one
    with pytest.raises(ConfigError, match="not cryptographic"):  # chosen, not a default
        SafeStorageWriter(tmp_path, options=WriterOptions(checksum="crc32"))


def test_options_that_would_make_a_signature_meaningless_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not cryptographic"):
        SafeStorageWriter(tmp_path, options=WriterOptions(signing_key=KEY, checksum="xxh3_128"))
    with pytest.raises(ConfigError, match="verify=False"):
        SafeStorageReader(tmp_path, signing_key=KEY, verify=False)
    with pytest.raises(ConfigError, match="at least 16"):
        SafeStorageReader(tmp_path, signing_key="short")


def test_replication_keeps_the_signature(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    writer = SafeStorageWriter(local, replicate_to=remote, options=WriterOptions(signing_key=KEY))
    dcp_safe.save(_state(), checkpoint_id="step_1", storage_writer=writer)
    writer.replication("step_1").result(timeout=60)
    writer.close()
    assert (remote / "step_1" / layout.SIGNATURE).read_bytes() == (
        local / "step_1" / layout.SIGNATURE
    ).read_bytes()
    assert torch.equal(_load(remote)["a"], _state()["a"])
    verify_checkpoint(remote, "step_1", signing_key=KEY)


def test_a_forged_replica_is_passed_over_for_the_signed_local_copy(tmp_path: Path) -> None:
    """With a fallback tier, a checkpoint the key did not sign there is simply not a candidate."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    _save(local, "step_1", step=1)
    _save(remote, "step_2", key=None, step=2)  # newer by step, but unsigned
    reader = SafeStorageReader(local, fallback=remote, signing_key=KEY)
    reader.reset("latest")
    assert reader.checkpoint_id == "step_1"


def test_cli_verify_takes_a_key_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _save(root, "signed")
    _save(root, "unsigned", key=None)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert main(["verify", str(root), "signed", "--signing-key-file", str(key_file)]) == EXIT_OK
    assert main(["verify", str(root), "unsigned"]) == EXIT_OK
    status = main(["verify", str(root), "unsigned", "--signing-key-file", str(key_file)])
    assert status == EXIT_FAILED


def test_the_signature_is_checked_over_the_bytes_the_reader_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is read once: the HMAC is checked against the digest of the bytes that were
    parsed, so a manifest swapped in after the open is never the one used, and a signed load
    pays no second read and parse of a manifest of thousands of items."""
    from dcp_safe.backends.local_backend import LocalBackend

    _save(tmp_path)
    forged = _manifest(tmp_path)
    forged["items"][0]["checksum"] = "blake3:" + "0" * 64
    reads: list[str] = []
    read_small = LocalBackend.read_small

    def read_then_swap(self: LocalBackend, rel: str, max_bytes: int) -> bytes:
        data = read_small(self, rel, max_bytes)
        if rel.endswith(layout.MANIFEST):
            reads.append(rel)
            (tmp_path / rel).write_text(json.dumps(forged))  # the attacker, just after the open
        return data

    monkeypatch.setattr(LocalBackend, "read_small", read_then_swap)
    loaded = _load(tmp_path)
    assert torch.equal(loaded["a"], _state()["a"]) and loaded["extra"] == {"epoch": 3}
    assert reads == ["step_1/" + layout.MANIFEST]
