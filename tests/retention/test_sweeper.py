"""The sweeper removes abandoned partial directories, never recent ones or checkpoints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from deep_trees import make_deep_tree, remove_deep_tree
from support import make_state
from support.faults import DiesInWriteData

import dcp_safe
from dcp_safe import ConfigError, SafeStorageWriter, cli, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.lease import acquire_lease
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import ReplicationSkippedError
from dcp_safe.replication.rank_upload import (
    UploadOptions,
    report_commit_failure,
    report_rank_failure,
)
from dcp_safe.replication.replicator import RankReplicator, RankSave
from dcp_safe.retention import sweeper
from dcp_safe.retention.apply import apply_retention
from dcp_safe.retention.sweeper import sweep_partials


def _abandon_a_save(root: Path) -> str:
    with pytest.raises(dcp_safe.CommitError):
        dcp_safe.save(make_state(1), checkpoint_id="step_2", storage_writer=DiesInWriteData(root))
    (partial,) = [e for e in os.listdir(root) if e.startswith(".")]
    return partial


def test_abandoned_partial_is_removed_after_the_grace_period(tmp_path: Path) -> None:
    dcp_safe.save(make_state(0), checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))
    partial = _abandon_a_save(tmp_path)
    report = sweep_partials(tmp_path, grace_s=60, now=time.time() + 61)
    assert report.removed == (partial,)
    assert os.listdir(tmp_path) == ["step_1"]
    dcp_safe.verify_checkpoint(tmp_path, "step_1")


def test_recent_partial_is_left_alone(tmp_path: Path) -> None:
    partial = _abandon_a_save(tmp_path)
    report = sweep_partials(tmp_path, grace_s=3600)
    assert report.too_recent == (partial,) and report.removed == ()
    assert (tmp_path / partial).is_dir()


def test_dry_run_removes_nothing(tmp_path: Path) -> None:
    partial = _abandon_a_save(tmp_path)
    report = sweep_partials(tmp_path, grace_s=0, dry_run=True)
    assert report.removed == (partial,) and report.dry_run
    assert (tmp_path / partial).is_dir()


def test_negative_grace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        sweep_partials(tmp_path, grace_s=-1)


@pytest.mark.s3
def test_object_store_sweep_collects_stale_leases_and_uploads_only(
    s3: Any,
    s3_bucket: str,
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    backend = open_backend(s3_root, s3_options)
    dcp_safe.save(
        make_state(0),
        checkpoint_id="step_1",
        storage_writer=SafeStorageWriter(s3_root, storage_options=s3_options),
    )
    acquire_lease(backend, "step_2", "killed-save")
    backend.write_bytes("step_2/__0_0.distcp", b"half a shard")
    prefix = s3_root.removeprefix(f"s3://{s3_bucket}/")
    s3.client().create_multipart_upload(Bucket=s3_bucket, Key=f"{prefix}/step_2/__1_0.distcp")

    early = sweep_partials(s3_root, grace_s=3600, storage_options=s3_options)
    assert early.removed == () and early.too_recent == ("step_2",) and early.aborted_uploads == ()

    report = sweep_partials(s3_root, grace_s=60, now=time.time() + 61, storage_options=s3_options)
    assert report.removed == ("step_2",)
    assert report.aborted_uploads == (f"s3://{s3_bucket}/{prefix}/step_2/__1_0.distcp",)
    assert s3.open_uploads(s3_bucket) == []
    assert backend.list_dir("") == ["step_1"]
    dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)


# ------------------------------------------------------------ only what dcp_safe made


def test_only_dcp_safe_partials_are_swept(tmp_path: Path) -> None:
    partial = _abandon_a_save(tmp_path)
    notes = tmp_path / ".notes.partial-draft"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    (tmp_path / ".step_2.partial-1234").mkdir()  # not a save id dcp_safe makes
    report = sweep_partials(tmp_path, grace_s=60, now=time.time() + 61)
    assert report.removed == (partial,) and report.too_recent == ()
    assert (notes / "todo.txt").read_text() == "mine"
    assert (tmp_path / ".step_2.partial-1234").is_dir()


def _leave_a_lease(backend: Any, name: str, body: bytes, lease: str = layout.WRITING_LEASE) -> None:
    backend.write_bytes(f"{name}/{lease}", body)
    backend.write_bytes(f"{name}/__0_0.distcp", b"half a shard")


def test_unreadable_and_far_future_leases_are_collected_after_the_grace_period(
    memory_root: str,
) -> None:
    backend = open_backend(memory_root)
    future = json.dumps({"save_id": "x", "acquired_at": time.time() + 1e9}).encode()
    _leave_a_lease(backend, "step_2", b"\x00not json")
    _leave_a_lease(backend, "step_3", future)
    _leave_a_lease(backend, "step_4", future, layout.lease_file_name("killed"))
    _leave_a_lease(backend, ".hidden", future)  # not a checkpoint name: not ours
    expected = ("step_2", "step_3", "step_4")
    early = sweep_partials(memory_root, grace_s=3600)
    assert early.too_recent == expected and early.removed == ()
    late = sweep_partials(memory_root, grace_s=3600, now=time.time() + 3601)
    assert late.removed == expected
    assert backend.list_dir("") == [".hidden"]


@pytest.mark.s3
def test_the_sweep_aborts_only_dcp_safe_uploads_under_its_root(
    s3: Any, s3_bucket: str, s3_root: str, s3_options: dict[str, Any]
) -> None:
    prefix = s3_root.removeprefix(f"s3://{s3_bucket}/")
    ours = f"{prefix}/step_2/__0_0.distcp"
    others = [
        f"{prefix}/other-app/blob.bin",  # not a name dcp_safe writes
        f"{prefix}/step_2/notes.bin",
        f"{prefix}-sibling/step_2/__0_0.distcp",  # beside the root
        "elsewhere/step_2/__0_0.distcp",  # outside it
    ]
    for key in [ours, *others]:
        s3.client().create_multipart_upload(Bucket=s3_bucket, Key=key)
    report = sweep_partials(s3_root, grace_s=60, now=time.time() + 61, storage_options=s3_options)
    assert report.aborted_uploads == (f"s3://{s3_bucket}/{ours}",)
    assert sorted(u["Key"] for u in s3.open_uploads(s3_bucket)) == sorted(others)


@pytest.mark.s3
def test_an_upload_without_a_start_time_is_aborted_only_with_its_abandoned_save(
    s3: Any,
    s3_bucket: str,
    s3_root: str,
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = open_backend(s3_root, s3_options)
    save = SafeStorageWriter(s3_root, storage_options=s3_options)
    dcp_safe.save(make_state(0), checkpoint_id="step_1", storage_writer=save)
    acquire_lease(backend, "step_2", "killed-save")
    prefix = s3_root.removeprefix(f"s3://{s3_bucket}/")
    kept, aborted = f"{prefix}/step_1/__9_0.distcp", f"{prefix}/step_2/__0_0.distcp"
    for key in (kept, aborted):
        s3.client().create_multipart_upload(Bucket=s3_bucket, Key=key)

    def without_times(backend: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in u.items() if k != "Initiated"} for u in listed(backend)]

    listed = sweeper.incomplete_uploads
    monkeypatch.setattr(sweeper, "incomplete_uploads", without_times)
    report = sweep_partials(s3_root, grace_s=60, now=time.time() + 61, storage_options=s3_options)
    assert report.removed == ("step_2",)
    assert report.aborted_uploads == (f"s3://{s3_bucket}/{aborted}",)
    assert [u["Key"] for u in s3.open_uploads(s3_bucket)] == [kept]


@pytest.mark.s3
def test_a_bucket_root_is_refused_without_the_flag(
    s3: Any, s3_bucket: str, s3_options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    s3.client().create_multipart_upload(Bucket=s3_bucket, Key="other-app/blob.bin")
    bucket = f"s3://{s3_bucket}"
    with pytest.raises(ConfigError, match="whole bucket"):
        sweep_partials(bucket, grace_s=0, storage_options=s3_options)
    with pytest.raises(ConfigError, match="whole bucket"):
        apply_retention(bucket, keep_last=2, grace_s=0, storage_options=s3_options)
    gc = ["gc", bucket, "--keep", "2", "--grace-s", "0"]
    gc += ["--storage-options", json.dumps(s3_options)]
    assert cli.main(gc) != 0
    err = capsys.readouterr().err
    assert "whole bucket" in err and len(err.strip().splitlines()) == 1, err
    assert cli.main([*gc, "--allow-bucket-root"]) == 0
    report = sweep_partials(bucket, grace_s=0, storage_options=s3_options, allow_bucket_root=True)
    assert report.aborted_uploads == ()
    assert [u["Key"] for u in s3.open_uploads(s3_bucket)] == ["other-app/blob.bin"]


def _stray_probes(backend: Any) -> tuple[str, str]:
    """A probe a killed process left (its exact form), and a user's object that only starts
    like one."""
    probe, lookalike = f"{layout.PROBE_PREFIX}{'0f' * 16}", f"{layout.PROBE_PREFIX}notes"
    backend.write_bytes(probe, b"first")
    backend.write_bytes(lookalike, b"mine")
    return probe, lookalike


def test_a_stray_probe_object_is_collected_after_the_grace_period() -> None:
    root = "memory://sweeper-probes"
    backend = open_backend(root)
    probe, lookalike = _stray_probes(backend)
    assert sweep_partials(root, grace_s=60).removed == ()  # still within the grace period
    report = sweep_partials(root, grace_s=60, now=time.time() + 61, dry_run=True)
    assert report.removed == (probe,) and backend.exists(probe)
    report = sweep_partials(root, grace_s=60, now=time.time() + 61)
    assert report.removed == (probe,)
    assert not backend.exists(probe) and backend.exists(lookalike)


@pytest.mark.s3
def test_a_stray_probe_object_is_collected_on_s3(s3_root: str, s3_options: dict[str, Any]) -> None:
    backend = open_backend(s3_root, s3_options)
    assert backend.supports_exclusive_create  # the probe ran, and removed its own object
    assert [e for e in backend.list_dir("") if e.startswith(layout.PROBE_PREFIX)] == []
    probe, lookalike = _stray_probes(backend)
    options = {"storage_options": s3_options}
    assert sweep_partials(s3_root, grace_s=60, **options).removed == ()
    report = sweep_partials(s3_root, grace_s=60, now=time.time() + 61, **options)
    assert report.removed == (probe,)
    assert not backend.exists(probe) and backend.exists(lookalike)


def test_an_unleased_prefix_of_only_dcp_safe_objects_is_collected_after_the_grace_period(
    memory_root: str,
) -> None:
    # A failed save's lease is released while a slow rank may still finish one file, and a
    # prune killed half-way leaves an unpublished prefix: nobody's save, nobody else's objects.
    backend = open_backend(memory_root)
    dcp_safe.save(
        make_state(0), checkpoint_id="step_1", storage_writer=SafeStorageWriter(memory_root)
    )
    backend.write_bytes("step_2/__1_0.distcp", b"a slow rank's last shard")
    backend.write_bytes(f"step_2/{layout.RANKS_DIR}/rank_00001.json", b"{}")
    backend.write_bytes("step_3/__0_0.distcp", b"looks like a shard")
    backend.write_bytes("step_3/notes.txt", b"but this is someone's folder")
    backend.write_bytes("step_4/readme.md", b"someone's folder")

    early = sweep_partials(memory_root, grace_s=3600)
    assert early.removed == () and early.too_recent == ("step_2",)
    late = sweep_partials(memory_root, grace_s=3600, now=time.time() + 3601)
    assert late.removed == ("step_2",)
    assert sorted(backend.list_dir("")) == ["step_1", "step_3", "step_4"]
    assert backend.read_bytes("step_3/notes.txt") == b"but this is someone's folder"
    dcp_safe.verify_checkpoint(memory_root, "step_1")


# ------------------------------------------------------------ markers of per-rank uploads


@pytest.fixture(params=["memory", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, memory_root: str) -> tuple[str, dict[str, Any] | None]:
    """A marker-published root that per-rank uploads report to."""
    if request.param == "s3":
        return request.getfixturevalue("s3_root"), request.getfixturevalue("s3_options")
    return memory_root, None


def _skip_a_replication(local: Path, remote: Any) -> str:
    """A rank's replicator drops ``step_2`` for ``step_3`` (the real coalescing path), leaving
    its skip marker as the only object under ``step_2/``; returns step_2's save id."""
    # A slow poll: the first save is still waiting for its local commit when the next two begin.
    options = UploadOptions(remote_timeout_s=60.0, poll_s=1.0)
    replicator = RankReplicator(open_backend(str(local)), remote, options=options)
    first = replicator.begin("step_1", RankSave("a" * 32, 1, 2))
    deadline = time.monotonic() + 60.0
    while not first.running() and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker took it: the next save is pending, not replacing it
    second = replicator.begin("step_2", RankSave("b" * 32, 1, 2))
    replicator.begin("step_3", RankSave("c" * 32, 1, 2))
    with pytest.raises(ReplicationSkippedError):
        second.result(timeout=60.0)
    with pytest.raises(dcp_safe.CommitError):  # nothing here ever commits locally
        replicator.close(timeout_s=60.0)
    return "b" * 32


def test_the_skip_marker_of_a_superseded_replication_is_collected_after_the_grace_period(
    remote: tuple[str, dict[str, Any] | None], tmp_path: Path
) -> None:
    url, options = remote
    backend = open_backend(url, options)
    save_id = _skip_a_replication(tmp_path, backend)
    [marker] = backend.walk_files("step_2")  # no lease, no commit: only the marker
    assert backend.list_dir("") == ["step_2"]

    early = sweep_partials(url, grace_s=3600, storage_options=options)
    assert early.removed == () and early.too_recent == ("step_2",)
    assert backend.exists(f"step_2/{marker}")
    late = sweep_partials(url, grace_s=3600, now=time.time() + 3601, storage_options=options)
    assert late.removed == ("step_2",)
    assert backend.list_dir("") == []
    assert marker == layout.rank_skip_marker_name(1, save_id)  # the name layout spells


def test_failure_markers_under_a_committed_checkpoint_are_collected_and_its_files_kept(
    remote: tuple[str, dict[str, Any] | None],
) -> None:
    """A failed per-rank upload of step_1 left its markers (no rank removes them); a later
    save of step_1 committed beside them. After the grace period only the markers go."""
    url, options = remote
    backend = open_backend(url, options)
    work = strategy_for(backend).work_dir("step_1", "a" * 32)
    report_rank_failure(backend, work, 1, "a" * 32, OSError("disk on fire"))
    report_commit_failure(backend, work, "a" * 32, TimeoutError("no quorum"))
    markers = sorted(backend.walk_files("step_1"))
    writer = SafeStorageWriter(url, storage_options=options)
    dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=writer)
    # A lease whose removal failed after the marker: debris too.
    backend.write_bytes(f"step_1/{layout.lease_file_name('released-late')}", b"{}")
    own = set(backend.walk_files("step_1")) - set(markers) - {"_WRITING-released-late"}

    early = sweep_partials(url, grace_s=3600, storage_options=options)
    assert early.removed == () and early.too_recent == ()
    late = sweep_partials(url, grace_s=3600, now=time.time() + 3601, storage_options=options)
    gone = [*markers, "_WRITING-released-late"]
    assert sorted(late.removed) == sorted(f"step_1/{rel}" for rel in gone)
    assert set(backend.walk_files("step_1")) == own
    dcp_safe.verify_checkpoint(url, "step_1", storage_options=options)
    assert sorted(markers) == sorted(
        [
            layout.commit_failure_marker_name("a" * 32),
            layout.rank_failure_marker_name(1, "a" * 32),
        ]
    )


# ---------------------------------------------------------------- damaged leftovers


def test_a_leftover_nested_thousands_deep_is_passed_by_and_breaks_no_later_prune(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once ``gc`` died of RecursionError on such a leftover, and so did every prune after."""
    dcp_safe.save(make_state(0), checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path))
    partial = _abandon_a_save(tmp_path)
    deep = tmp_path / f".step_9{layout.PARTIAL_INFIX}{'a' * 32}"
    make_deep_tree(deep, 3000, mtime=1.0)
    try:
        with caplog.at_level("WARNING", logger="dcp_safe"):
            report = sweep_partials(tmp_path, grace_s=60, now=time.time() + 61)
        assert report.removed == (partial,)
        assert any(
            "left alone" in r.getMessage() and deep.name in r.getMessage() for r in caplog.records
        )

        assert cli.main(["gc", str(tmp_path), "--keep", "1", "--grace-s", "0"]) == 0
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert [line for line in err.splitlines() if deep.name in line] == [
            line for line in err.splitlines() if line.startswith("dcp-safe: warning: left alone")
        ]

        manager = dcp_safe.CheckpointManager(tmp_path, keep_last=1)
        try:
            manager.save(2, make_state(2))
            manager.wait()
            manager.prune()  # sweeps the root: the leftover is passed by again
        finally:
            manager.close()
        assert "step_000000002" in os.listdir(tmp_path) and deep.is_dir()
    finally:
        remove_deep_tree(deep)


def test_an_empty_folder_under_a_checkpoint_name_is_refused_clearly_then_collected(
    tmp_path: Path,
) -> None:
    """It would refuse every save of its name; the refusal says what is in the way and what
    to do, and the sweeper collects it, never a folder that holds anything."""
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "notes.txt").write_text("mine")
    with pytest.raises(dcp_safe.errors.CheckpointExistsError) as caught:
        dcp_safe.save(
            make_state(2), checkpoint_id="step_2", storage_writer=SafeStorageWriter(tmp_path)
        )
    message = str(caught.value)
    assert str(tmp_path / "step_2") in message and "no _COMMITTED marker" in message
    assert "dcp-safe gc" in message

    assert sweep_partials(tmp_path, grace_s=3600).too_recent == ("step_2",)
    report = sweep_partials(tmp_path, grace_s=60, now=time.time() + 61)
    assert report.removed == ("step_2",)
    assert (tmp_path / "step_3" / "notes.txt").read_text() == "mine"
    dcp_safe.save(make_state(2), checkpoint_id="step_2", storage_writer=SafeStorageWriter(tmp_path))
    dcp_safe.verify_checkpoint(tmp_path, "step_2")


def test_a_nan_grace_period_is_refused_before_anything_is_removed(tmp_path: Path) -> None:
    """NaN compares false with every age: it would have collected every partial at once."""
    partial = _abandon_a_save(tmp_path)
    with pytest.raises(ConfigError):
        sweep_partials(tmp_path, grace_s=float("nan"))
    with pytest.raises(ConfigError):
        apply_retention(tmp_path, keep_last=1, grace_s=float("nan"))
    assert (tmp_path / partial).is_dir()


def test_a_stock_dcp_checkpoint_under_the_root_is_never_collected(
    remote: tuple[str, dict[str, Any] | None], tmp_path: Path
) -> None:
    # A folder DCP's own FileSystemWriter finished (its .metadata and shards, no lease, no
    # marker) is somebody's checkpoint, perhaps waiting to be adopted: only names dcp_safe also
    # writes, yet no leftover of a save of ours, which always leaves its rank manifests.
    import torch.distributed.checkpoint as dcp

    url, options = remote
    backend = open_backend(url, options)
    dcp.save(
        make_state(0), storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True
    )
    for path in sorted((tmp_path / "stock").iterdir()):
        backend.write_bytes(f"step_7/{path.name}", path.read_bytes())
    backend.write_bytes("step_8/__0_0.distcp", b"a failed save's shard")
    backend.write_bytes(f"step_8/{layout.RANKS_DIR}/rank_00000.json", b"{}")

    report = sweep_partials(url, grace_s=0, now=time.time() + 10, storage_options=options)
    assert report.removed == ("step_8",)
    assert sorted(backend.list_dir("step_7")) == sorted(
        p.name for p in (tmp_path / "stock").iterdir()
    )
