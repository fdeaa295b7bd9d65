"""The trash (dcp_safe.retention.trash): pruned checkpoints wait there, restorable, for
``trash_grace_s``; a prune, an expiry or a restore cut short anywhere leaves every checkpoint
committed, in the trash, or gone; and ``keep_best`` ranks by the metrics saves record."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from _crash import CHILD_DONE, fork_and_wait, install_kill_switch
from support import assert_state_equal, blank_like, make_state
from support.counting import ready_worker

import dcp_safe
from dcp_safe import (
    Bounds,
    CheckpointManager,
    Retention,
    Runtime,
    SafeStorageWriter,
    Topology,
    WriterOptions,
)
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.roots import open_backend
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    SignatureError,
)
from dcp_safe.manager import HISTORY_FILE
from dcp_safe.retention.apply import apply_retention
from dcp_safe.retention.sweeper import sweep_trash
from dcp_safe.retention.trash import restore_trashed, trash, trash_entries
from dcp_safe.staging import MemoryBudget
from dcp_safe.topology import Root

BUDGET = MemoryBudget(usable_bytes=1 << 28, reserve_bytes=0)


def _save(root: str | Path, step: int, **options: Any) -> str:
    name = f"step_{step}"
    writer = SafeStorageWriter(root, step=step, options=WriterOptions(fsync=False), **options)
    dcp_safe.save(make_state(step), checkpoint_id=name, storage_writer=writer)
    return name


def _names(root: str | Path, **options: Any) -> list[str]:
    return [i.name for i in dcp_safe.list_checkpoints(root, storage_options=options or None)]


def _manager(root: str | Path, **retention: Any) -> CheckpointManager:
    return CheckpointManager(root, retention=Retention(**retention), bounds=Bounds(budget=BUDGET))


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def any_root(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A root that renames (local) or one that publishes with a marker (memory://, S3)."""
    if request.param == "s3":
        return request.getfixturevalue("s3_root"), request.getfixturevalue("s3_options")
    if request.param == "memory":
        return request.getfixturevalue("memory_root"), {}
    return str(tmp_path), {}


# ------------------------------------------------------------------ metrics and keep_best


@pytest.mark.parametrize(
    ("losses", "kept"),
    [
        ({1: 5.0, 2: 1.0, 3: 4.0, 4: 6.0, 5: 2.0, 6: 7.0}, [2, 5, 6]),  # best two: 2 and 5
        # Best two: 2 and 4. The second newest (5) goes: with the newest, they are the two
        # validated checkpoints the safety rules ask for.
        ({1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0}, [2, 4, 6]),
    ],
)
def test_keep_best_keeps_exactly_the_best_k_and_the_newest(
    tmp_path: Path, losses: dict[int, float], kept: list[int]
) -> None:
    with _manager(tmp_path, keep_last=1, keep_best=(2, "val_loss", "min")) as manager:
        for step, loss in losses.items():
            state = {"w": torch.full((4,), float(step))}
            handle = manager.save(step, state, metrics={"val_loss": loss})
            assert handle is not None
            handle.committed.result()
    assert _names(tmp_path) == [f"step_{step:09d}" for step in kept]


def test_keep_best_by_max_passes_by_checkpoints_without_the_metric(tmp_path: Path) -> None:
    metrics: dict[int, dict[str, Any]] = {
        1: {"acc": 0.9},
        2: {"loss": 0.1},  # no "acc": never among the best
        3: {"acc": "n/a"},  # a label, not a number: likewise
        4: {"acc": 0.5},
        5: {"acc": 0.7},
        6: {"acc": 0.1},
    }
    with _manager(tmp_path, keep_last=1, keep_best=(2, "acc", "max")) as manager:
        for step, values in metrics.items():
            handle = manager.save(step, {"w": torch.zeros(2)}, metrics=values)
            assert handle is not None
            handle.committed.result()
    assert _names(tmp_path) == ["step_000000001", "step_000000005", "step_000000006"]


def test_metrics_are_in_the_manifest_the_listing_and_the_history(tmp_path: Path) -> None:
    metrics = {"val_loss": 0.25, "tokens": 4096, "config": "sha256:abc", "data": "shard-3:17"}
    with _manager(tmp_path) as manager:
        handle = manager.save(1, {"w": torch.zeros(2)}, metrics=metrics)
        assert handle is not None
        handle.committed.result()
        manager.save(2, {"w": torch.zeros(2)}).committed.result()  # type: ignore[union-attr]
    stored = {**metrics, "tokens": 4096.0}
    infos = dcp_safe.list_checkpoints(tmp_path)
    assert [i.metrics for i in infos] == [stored, None]
    manifest = json.loads((tmp_path / "step_000000001" / "manifest.json").read_bytes())
    assert manifest["metrics"] == stored
    assert "metrics" not in json.loads((tmp_path / "step_000000002" / "manifest.json").read_text())
    events = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    committed = [e for e in events if e["event"] == "committed"]
    assert [e.get("metrics") for e in committed] == [stored, None]


def test_metrics_are_covered_by_the_marker(tmp_path: Path) -> None:
    with _manager(tmp_path) as manager:
        manager.save(1, {"w": torch.zeros(2)}, metrics={"val_loss": 2.0}).committed.result()  # type: ignore[union-attr]
    path = tmp_path / "step_000000001" / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"val_loss":2.0', b'"val_loss":0.5'))
    assert _names(tmp_path) == []  # the marker no longer names these bytes: damaged, not listed


@pytest.mark.parametrize(
    "metrics",
    [
        {"val_loss": float("nan")},
        {"val_loss": float("inf")},
        {"": 1.0},
        {"x" * 65: 1.0},
        {"flag": True},
        {"value": None},
        {"label": "x" * 256},
        {"label": "a\nb"},
        {f"m{i}": 1.0 for i in range(65)},
        [("val_loss", 1.0)],
    ],
)
def test_bad_metrics_are_a_config_error_and_save_nothing(tmp_path: Path, metrics: Any) -> None:
    with _manager(tmp_path) as manager, pytest.raises(ConfigError, match="metric"):
        manager.save(1, {"w": torch.zeros(2)}, metrics=metrics)
    assert _names(tmp_path) == []


# ------------------------------------------------------------------ the trash


def test_a_prune_moves_to_the_trash_and_gc_restore_brings_back_a_loadable_one(
    any_root: tuple[str, dict[str, Any]],
) -> None:
    root, options = any_root
    retention = Retention(keep_last=1, trash_grace_s=3600.0)
    topology = Topology.of(root, storage_options=options or None)
    states = {step: {"w": torch.full((8,), float(step))} for step in (1, 2, 3)}
    with CheckpointManager(topology, retention=retention, bounds=Bounds(budget=BUDGET)) as manager:
        for step, state in states.items():
            manager.save(step, state).committed.result()  # type: ignore[union-attr]
    assert _names(root, **options) == ["step_000000002", "step_000000003"]
    backend = open_backend(topology.commit)
    assert [name for name, _ in trash_entries(backend)] == ["step_000000001"]
    with pytest.raises(CheckpointNotFoundError):
        dcp_safe.verify_checkpoint(topology.commit, "step_000000001")

    report = restore_trashed(topology.commit, "step_000000001")
    assert report.name == "step_000000001" and report.items_checked == 1
    assert trash_entries(backend) == []
    with CheckpointManager(topology, retention=retention, bounds=Bounds(budget=BUDGET)) as manager:
        target = {"w": torch.zeros(8)}
        assert manager.restore(target, step=1) == "step_000000001"
    assert torch.equal(target["w"], states[1]["w"])


def test_after_the_grace_period_it_is_gone(any_root: tuple[str, dict[str, Any]]) -> None:
    root, options = any_root
    backend = open_backend(root, options or None)
    name = _save(root, 1, storage_options=options or None)
    newest = _save(root, 2, storage_options=options or None)
    trash(backend, name)
    early = sweep_trash(backend, 3600.0)
    assert early.removed == () and len(early.too_recent) == 1
    late = sweep_trash(backend, 3600.0, now=time.time() + 3601)
    assert len(late.removed) == 1
    assert trash_entries(backend) == []
    with pytest.raises(CheckpointNotFoundError, match="not in the trash"):
        restore_trashed(root, name, storage_options=options or None)
    assert _names(root, **options) == [newest]
    assert [e for e in backend.list_dir("") if "step_1" in e] == []


def test_restoring_over_a_name_committed_anew_is_refused(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    trash(backend, _save(tmp_path, 1))
    _save(tmp_path, 1)  # a root that renames: a new save of the name is a new checkpoint
    with pytest.raises(CheckpointExistsError):
        restore_trashed(tmp_path, "step_1")
    assert [name for name, _ in trash_entries(backend)] == ["step_1"]


def test_a_save_never_claims_a_name_in_the_trash_on_an_object_store(memory_root: str) -> None:
    backend = open_backend(memory_root)
    trash(backend, _save(memory_root, 1))
    with pytest.raises(CheckpointExistsError, match="in the trash"):
        _save(memory_root, 1)
    restore_trashed(memory_root, "step_1")  # its own files, whole
    dcp_safe.verify_checkpoint(memory_root, "step_1")


def test_the_manager_deletes_expired_trash_in_the_background(tmp_path: Path) -> None:
    with _manager(tmp_path, keep_last=1, trash_grace_s=1e-9) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, {"w": torch.zeros(2)}).committed.result()  # type: ignore[union-attr]
        expiry = manager._tiers._expiry
        assert expiry is not None
    expiry.join(60.0)
    manager._tiers._expire()  # one more pass: the one running at close may have begun before
    assert sorted(p.name for p in tmp_path.iterdir() if "step" in p.name) == [
        "step_000000003",
        "step_000000004",
    ]


# ------------------------------------------------------------------ cut short anywhere


def _state_of(root: str, name: str, expected: dict[str, Any], **options: Any) -> str:
    """``committed``, ``trash`` or ``gone``: whichever ``name`` is, each checked whole (a
    committed one verifies and loads as saved; one in the trash restores and loads)."""
    where = Root(root, options or None)
    if name in _names(root, **options):
        state = "committed"
    else:
        try:
            restore_trashed(where, name)
        except CheckpointNotFoundError:
            return "gone"
        state = "trash"
    dcp_safe.verify_checkpoint(where, name)
    loaded = blank_like(expected)
    dcp_safe.load(loaded, checkpoint_id=name, storage_reader=dcp_safe.SafeStorageReader(where))
    assert_state_equal(loaded, expected)
    return state


def _sweep_kills(
    tmp_path: Path, prepare: Callable[[Backend], object], work: Callable[[str], object]
) -> set[str]:
    """Kill ``work`` (after ``prepare``, on a fresh root each time) just before each of its
    storage operations in turn, until it finishes; the states ``step_1`` was found in."""
    seen: set[str] = set()
    for kill_at in range(1, 500):
        root = tmp_path / f"kill_{kill_at}"
        _save(root, 1)
        _save(root, 2)
        prepare(open_backend(str(root)))

        def child(root: Path = root, kill_at: int = kill_at) -> None:
            install_kill_switch(kill_at)
            work(str(root))

        code = fork_and_wait(child)
        seen.add(_state_of(str(root), "step_1", make_state(1)))
        assert _state_of(str(root), "step_2", make_state(2)) == "committed"
        shutil.rmtree(root)
        if code == CHILD_DONE:
            return seen
    raise AssertionError("the work never finished")


def _prune_then_expire(root: str) -> None:
    backend = open_backend(root)
    trash(backend, "step_1")
    sweep_trash(backend, 0.0, now=time.time() + 1)


def test_a_prune_killed_anywhere_leaves_the_trash_consistent(tmp_path: Path) -> None:
    seen = _sweep_kills(tmp_path, lambda backend: None, _prune_then_expire)
    assert seen == {"committed", "trash", "gone"}


def test_a_restore_killed_anywhere_leaves_the_trash_consistent(tmp_path: Path) -> None:
    seen = _sweep_kills(
        tmp_path, lambda b: trash(b, "step_1"), lambda r: restore_trashed(r, "step_1")
    )
    assert seen == {"committed", "trash"}


class _CutShort(Exception):
    pass


def _cut_short_at(patch: pytest.MonkeyPatch, call: int) -> None:
    """Make the ``call``-th write or removal of every object-store backend raise instead (a
    process gone there)."""
    count = [0]
    for method in ("write_bytes", "remove_file", "remove_tree"):
        real = getattr(FsspecBackend, method)

        def step(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == call:
                raise _CutShort
            return _real(*args, **kwargs)

        patch.setattr(FsspecBackend, method, step)


@pytest.mark.parametrize("store", ["memory", pytest.param("s3", marks=pytest.mark.s3)])
@pytest.mark.parametrize("work", ["prune", "restore"])
def test_a_prune_or_restore_cut_short_on_an_object_store_leaves_the_trash_consistent(
    work: str, store: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    options: dict[str, Any] = {}
    if store == "s3":
        base, options = request.getfixturevalue("s3_root"), request.getfixturevalue("s3_options")
    seen = set()
    for call in range(1, 50):
        root = f"{base}/cut-{call}" if store == "s3" else f"memory://cut-{uuid.uuid4().hex}"
        _save(root, 1, storage_options=options or None)
        _save(root, 2, storage_options=options or None)
        backend = open_backend(root, options or None)
        if work == "restore":
            trash(backend, "step_1")
        finished = True
        with monkeypatch.context() as patch:
            _cut_short_at(patch, call)
            try:
                if work == "prune":
                    trash(backend, "step_1")
                    sweep_trash(backend, 0.0, now=time.time() + 1)
                else:
                    restore_trashed(root, "step_1", storage_options=options or None)
            except _CutShort:
                finished = False
        seen.add(_state_of(root, "step_1", make_state(1), **options))
        assert _state_of(root, "step_2", make_state(2), **options) == "committed"
        if store == "memory":
            fsspec.filesystem("memory").rm(root, recursive=True)
        if finished:
            break
    assert seen == ({"committed", "trash", "gone"} if work == "prune" else {"committed", "trash"})


@pytest.mark.worker_process
def test_metrics_reach_the_manifest_from_the_worker_process(tmp_path: Path) -> None:
    runtime = Runtime(executor="process")
    with CheckpointManager(tmp_path, runtime=runtime, bounds=Bounds(budget=BUDGET)) as manager:
        ready_worker(manager)
        handle = manager.save(1, {"w": torch.zeros(2)}, metrics={"val_loss": 0.5, "data": "s3"})
        assert handle is not None
        handle.committed.result()
        assert manager.stats().worker_saves == 1
    assert [i.metrics for i in dcp_safe.list_checkpoints(tmp_path)] == [
        {"val_loss": 0.5, "data": "s3"}
    ]


def test_gc_expires_the_trash_when_asked_and_refuses_a_negative_grace(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    for step in (1, 2, 3):
        _save(tmp_path, step)
    trash(backend, "step_1")
    kept = apply_retention(tmp_path, keep_last=5, trash_grace_s=3600.0)
    assert kept.trash is not None and len(kept.trash.too_recent) == 1
    assert apply_retention(tmp_path, keep_last=5).trash is None
    gone = apply_retention(tmp_path, keep_last=5, trash_grace_s=0.0)
    assert gone.trash is not None and len(gone.trash.removed) == 1 and trash_entries(backend) == []
    with pytest.raises(ConfigError, match="grace"):
        apply_retention(tmp_path, keep_last=5, trash_grace_s=-1.0)


def test_a_damaged_checkpoint_in_the_trash_is_not_restored_and_stays_there(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    trash(backend, _save(tmp_path, 1))
    _save(tmp_path, 2)
    ((_, folder),) = trash_entries(backend)
    shard = next((tmp_path / folder).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError):
        restore_trashed(tmp_path, "step_1")
    assert trash_entries(backend) == [("step_1", folder)] and _names(tmp_path) == ["step_2"]


def test_a_signed_checkpoint_is_restored_only_under_its_key(tmp_path: Path) -> None:
    key = "hex:" + "5a" * 32
    options = WriterOptions(fsync=False, signing_key=key)  # type: ignore[arg-type]
    writer = SafeStorageWriter(tmp_path, step=1, options=options)
    dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=writer)
    trash(open_backend(str(tmp_path)), "step_1")
    with pytest.raises(SignatureError):
        restore_trashed(tmp_path, "step_1", signing_key="hex:" + "77" * 32)
    restore_trashed(tmp_path, "step_1", signing_key=key)
    dcp_safe.verify_checkpoint(tmp_path, "step_1", signing_key=key)
