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
