"""``apply_retention`` drops what the policy lets go and sweeps old partial saves, on real roots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support import make_state
from support.faults import abandon_a_save

import dcp_safe
from dcp_safe import ConfigError, SafeStorageWriter, WriterOptions
from dcp_safe.manifest.signing import SIGNING_KEY_ENV
from dcp_safe.retention.apply import apply_retention

KEY = "hex:" + "5a" * 32


def _save(
    root: str | Path, step: int | None, name: str, signing_key: str | None = None, **kwargs: Any
) -> None:
    options = WriterOptions(fsync=False, signing_key=signing_key)  # type: ignore[arg-type]
    writer = SafeStorageWriter(root, step=step, options=options, **kwargs)
    dcp_safe.save(make_state(step or 0), checkpoint_id=name, storage_writer=writer)


def _names(root: str | Path, **options: Any) -> list[str]:
    return [i.name for i in dcp_safe.list_checkpoints(root, storage_options=options or None)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A local root holding step_0001..step_0004, committed."""
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, f"step_{step:04d}")
    return tmp_path


def test_keeps_the_newest_and_removes_the_rest(root: Path) -> None:
    report = apply_retention(root, keep_last=2)
    assert report.dropped == ("step_0001", "step_0002")
    assert report.kept == ("step_0003", "step_0004")
    assert not report.dry_run
    assert _names(root) == ["step_0003", "step_0004"]
    assert sorted(os.listdir(root)) == ["step_0003", "step_0004"]


def test_dry_run_reports_the_same_and_removes_nothing(root: Path) -> None:
    old = abandon_a_save(root, "step_0005")
    before = sorted(os.listdir(root))
    report = apply_retention(root, keep_last=2, dry_run=True, grace_s=0)
    assert report.dry_run and report.sweep.dry_run
    assert report.dropped == ("step_0001", "step_0002")
    assert report.sweep.removed == (old,)
    assert sorted(os.listdir(root)) == before


def test_the_two_newest_are_kept_whatever_keep_last_says(root: Path) -> None:
    report = apply_retention(root, keep_last=0)
    assert report.kept == ("step_0003", "step_0004")
    assert _names(root) == ["step_0003", "step_0004"]


def test_leaves_a_partial_save_idle_for_less_than_the_grace_period(root: Path) -> None:
    partial = abandon_a_save(root, "step_0005")
    report = apply_retention(root, keep_last=4, grace_s=3600)
    assert report.dropped == ()
    assert (report.sweep.removed, report.sweep.too_recent) == ((), (partial,))
    assert (root / partial).exists()


def test_sweeps_a_partial_save_idle_for_longer_than_the_grace_period(root: Path) -> None:
    partial = abandon_a_save(root, "step_0005")
    report = apply_retention(root, keep_last=4, grace_s=0)
    assert (report.sweep.removed, report.sweep.too_recent) == ((partial,), ())
    assert not (root / partial).exists()
    assert _names(root) == ["step_0001", "step_0002", "step_0003", "step_0004"]


def test_checkpoints_without_a_step_are_left_alone(root: Path) -> None:
    _save(root, None, "adhoc")
    report = apply_retention(root, keep_last=2)
    assert "adhoc" not in report.kept + report.dropped
    assert "adhoc" in _names(root)


def test_a_negative_keep_last_is_a_config_error(root: Path) -> None:
    with pytest.raises(ConfigError, match="KeepLast"):
        apply_retention(root, keep_last=-1)
    assert len(_names(root)) == 4


def test_with_a_key_planted_unsigned_steps_never_push_signed_ones_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    for step in (1, 2, 3):
        _save(tmp_path, step, f"step_{step:04d}", signing_key=KEY)
    for step in (8, 9):  # by a writer of the root without the key, steps ahead
        _save(tmp_path, step, f"step_{step:04d}")
    report = apply_retention(tmp_path, keep_last=2, signing_key=KEY)
    assert (report.kept, report.dropped) == (("step_0002", "step_0003"), ("step_0001",))
    assert sorted(report.not_counted) == ["step_0008", "step_0009"]
    assert _names(tmp_path) == ["step_0002", "step_0003", "step_0008", "step_0009"]


@pytest.mark.s3
def test_applies_retention_on_s3(
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    for step in (1, 2, 3):
        _save(s3_root, step, f"step_{step:04d}", storage_options=s3_options)
    report = apply_retention(s3_root, keep_last=2, storage_options=s3_options)
    assert report.dropped == ("step_0001",)
    assert _names(s3_root, **s3_options) == ["step_0002", "step_0003"]


def test_a_retire_that_fails_while_storage_cannot_say_what_is_left_warns_and_goes_on(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # step_0001's retire fails and so does the look at its marker after it: it is reported
    # kept (the next pass tries again), and the rest of the pass still runs.
    from dcp_safe.backends.local_backend import LocalBackend
    from dcp_safe.retention import apply

    failed: list[str] = []
    exists, strategy_for = LocalBackend.exists, apply.strategy_for

    class FailingFirst:
        def __init__(self, backend: Any) -> None:
            self.inner = strategy_for(backend)

        def retire(self, backend: Any, name: str) -> None:
            if name == "step_0001":
                failed.append(name)
                raise OSError("the disk went read-only")
            self.inner.retire(backend, name)

    def failing_exists(self: LocalBackend, rel: str) -> bool:
        if failed and rel.startswith("step_0001/"):
            raise OSError("the disk went away")
        return exists(self, rel)

    monkeypatch.setattr(apply, "strategy_for", FailingFirst)
    monkeypatch.setattr(LocalBackend, "exists", failing_exists)
    report = apply_retention(root, keep_last=2)
    assert report.dropped == ("step_0002",)
    assert "retiring" in caplog.text and "read-only" in caplog.text
    failed.clear()
    assert _names(root) == ["step_0001", "step_0003", "step_0004"]
