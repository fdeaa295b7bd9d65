"""The sweeper removes abandoned partial directories, never recent ones or checkpoints."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from support import make_state

import dcp_safe
from dcp_safe import ConfigError, SafeStorageWriter
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.lease import acquire_lease
from dcp_safe.retention.sweeper import sweep_partials


class _DiesInWriteData(SafeStorageWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(5, "Input/output error (injected)")


def _abandon_a_save(root: Path) -> str:
    with pytest.raises(dcp_safe.CommitError):
        dcp_safe.save(make_state(1), checkpoint_id="step_2", storage_writer=_DiesInWriteData(root))
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
