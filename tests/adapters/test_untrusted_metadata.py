"""DCP's metadata is never unpickled in the trust path: what a writer of the root puts in
``.metadata`` cannot reach a load, a verification or ``dcp-safe inspect``.

Each test writes ``.metadata`` as anyone who can write the root can (re-checksummed, manifest
and marker rewritten): a pickle of DCP's own types that ``BUILD``s onto DCP's classes, one whose
fields have the wrong types, one of memo-shared lists, one that places the items in a file
outside the checkpoint. A checkpoint with the plain metadata ignores it; one without it (as
written before) is refused unless the caller passes ``allow_pickle=True``, and then goes through
the same decoder.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_items import (
    SHARD,
    memo_shared_metadata,
    outside_metadata,
    pickled_metadata,
    poisoned_metadata,
    replace_metadata,
    strip_plain_metadata,
    wrong_types_metadata,
)
from support import assert_state_equal, blank_like, make_state
from torch.distributed.checkpoint.metadata import MetadataIndex

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.cli import main as cli_main
from dcp_safe.errors import UnsafeCheckpointError

NAME = "step_1"


def _save(root: Path, seed: int = 1) -> dict[str, Any]:
    state = make_state(seed)
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False))
    dcp_safe.save(state, checkpoint_id=NAME, storage_writer=writer, no_dist=True)
    return state


def _load(root: Path, state: dict[str, Any], *, allow_pickle: bool = False) -> dict[str, Any]:
    target = blank_like(state)
    reader = SafeStorageReader(root, allow_pickle=allow_pickle)
    dcp_safe.load(target, checkpoint_id=NAME, storage_reader=reader, no_dist=True)
    return target


@pytest.fixture
def dcp_classes_restored() -> Iterator[None]:
    """Whatever a failing test poisoned, the next test finds DCP's classes as they were."""
    eq = MetadataIndex.__dict__["__eq__"]
    yield
    if MetadataIndex.__dict__["__eq__"] is not eq:
        MetadataIndex.__eq__ = eq  # type: ignore[method-assign]


@pytest.fixture
def alarm() -> Iterator[None]:
    """A guard against a hang (not a time limit on the test): 120 s, then a failure."""

    def hung(signum: int, frame: Any) -> None:
        raise AssertionError("still running after 120 s: walking what the pickle shared")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _still_sound(tmp_path: Path) -> None:
    root = tmp_path / "after"
    state = _save(root, seed=9)
    assert_state_equal(_load(root, state), state)
    dcp_safe.verify_checkpoint(root, NAME)


@pytest.mark.usefixtures("dcp_classes_restored")
@pytest.mark.parametrize("plain", [True, False], ids=["with-plain-metadata", "written-before"])
def test_metadata_that_builds_onto_dcp_classes_poisons_nothing(tmp_path: Path, plain: bool) -> None:
    """Only DCP's own globals, but a BUILD that replaces ``MetadataIndex.__eq__``: the
    restricted unpickler ran it, and every later load and save of the process broke."""
    root = tmp_path / "root"
    state = _save(root)
    eq = MetadataIndex.__dict__["__eq__"]
    replace_metadata(root, NAME, poisoned_metadata(pickled_metadata(root, NAME)))
    if plain:
        assert_state_equal(_load(root, state), state)
    else:
        strip_plain_metadata(root, NAME)
        with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
            _load(root, state)
        with pytest.raises(UnsafeCheckpointError):
            dcp_safe.verify_checkpoint(root, NAME)
    assert MetadataIndex.__dict__["__eq__"] is eq
    _still_sound(tmp_path)


def test_relative_paths_in_metadata_never_lead_a_load_outside_the_manifests_files(
    tmp_path: Path,
) -> None:
    """``.metadata`` places every item in a copy of the shard outside the root, and the shard
    itself is gone: the load read the copy (and verify refused the checkpoint)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    state = _save(root)
    outside.mkdir()
    shutil.copy(root / NAME / SHARD, outside / "copy.distcp")
    metadata = outside_metadata(pickled_metadata(root, NAME), "../../outside/copy.distcp")
    replace_metadata(root, NAME, metadata)
    (root / NAME / SHARD).unlink()
    with pytest.raises(CheckpointCorruptError) as caught:
        _load(root, state)
    assert caught.value.path.endswith(f"{NAME}/{SHARD}")  # the manifest's file, not the copy
    # A checkpoint without the plain form, loaded by a caller who trusts the root: its
    # storage map must still agree with the manifest item by item.
    shutil.copy(outside / "copy.distcp", root / NAME / SHARD)
    strip_plain_metadata(root, NAME)
    with pytest.raises(CheckpointCorruptError, match="disagrees with the manifest"):
        _load(root, state, allow_pickle=True)


def test_wrong_field_types_in_metadata_are_typed_errors_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP's own types holding a string for a size and a number for chunks: load and restore
    raised a raw AttributeError or TypeError, ``dcp-safe inspect`` printed a traceback, and
    verify said the checkpoint loads safely."""
    root = tmp_path / "root"
    state = _save(root)
    replace_metadata(root, NAME, wrong_types_metadata(pickled_metadata(root, NAME)))
    strip_plain_metadata(root, NAME)
    with pytest.raises(UnsafeCheckpointError):
        _load(root, state)
    with pytest.raises(CheckpointCorruptError) as trusted:
        _load(root, state, allow_pickle=True)
    assert not isinstance(trusted.value, UnsafeCheckpointError)
    with pytest.raises(UnsafeCheckpointError):
        dcp_safe.verify_checkpoint(root, NAME)
    capsys.readouterr()
    status = cli_main(["inspect", str(root), NAME])
    out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1 and err.startswith("dcp-safe: error:")
    _still_sound(tmp_path)


@pytest.mark.usefixtures("alarm")
def test_memo_shared_metadata_is_never_walked(tmp_path: Path) -> None:
    """A small ``.metadata`` in which 4,000 entries share one list of 4,000 chunks: 16 million
    to walk, and ``latest``, restore and inspect spent minutes on it."""
    root = tmp_path / "root"
    state = _save(root)
    shared = memo_shared_metadata(pickled_metadata(root, NAME))
    assert len(shared) < 256 << 10
    replace_metadata(root, NAME, shared)
    strip_plain_metadata(root, NAME)
    with pytest.raises(UnsafeCheckpointError):
        _load(root, state)
    with pytest.raises(CheckpointCorruptError):  # trusted: refused by the walk's budget
        _load(root, state, allow_pickle=True)
    with pytest.raises(UnsafeCheckpointError):
        dcp_safe.verify_checkpoint(root, NAME)
    _still_sound(tmp_path)


def test_a_checkpoint_with_plain_metadata_never_touches_the_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Load, verify and inspect decode the one plain form; no unpickler runs on .metadata."""
    root = tmp_path / "root"
    state = _save(root)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(".metadata was unpickled")

    monkeypatch.setattr("pickle.loads", refuse)
    assert_state_equal(_load(root, state), state)
    dcp_safe.verify_checkpoint(root, NAME)
    assert cli_main(["inspect", str(root), NAME, "--json"]) == 0
    assert torch.equal(_load(root, state)["f32"], state["f32"])
