"""``dcp-safe demo`` as a user runs it: a real subprocess, real training, moto S3, a restore."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import dcp_safe
from dcp_safe.cli import EXIT_OK, main

pytestmark = pytest.mark.subprocess

# Generous: only a guard against a hung demo, never a measure of speed.
_DEMO_TIMEOUT_S = 300


def test_demo_restores_from_s3_alone_and_reports_stall_memory_and_cuts(tmp_path: Path) -> None:
    root = tmp_path / "demo-root"
    exe = Path(sys.executable).with_name("dcp-safe")
    done = subprocess.run(
        [str(exe), "demo", "--root", str(root), "--steps", "12", "--save-every", "4"],
        capture_output=True,
        text=True,
        timeout=_DEMO_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    out = done.stdout
    assert "restore of step_000012 from S3 alone: PASSED" in out
    # One line per save as it happens, then the table and the summary.
    for step in (4, 8, 12):
        assert f"step_{step:06d}: training stall" in out
    assert "Training stall per checkpoint" in out
    assert "training stall, median of 3 saves" in out
    assert "staging pool peak" in out and "envelope" in out
    assert "host memory (dcp_safe.telemetry.MemorySampler" in out
    assert "checkpoint worker process (executor='process'" in out  # the default
    assert "committed cut local: step 12 (step_000012)" in out
    assert "committed cut S3   : step 12 (step_000012)" in out
    assert "saves: 3 requested, 3 committed, 0 skipped, 0 failed" in out
    # No save waited for the worker's start-up, so nothing tripped the synchronous fallback.
    assert "0 synchronous (fallback: none)" in out
    assert "falling back to synchronous" not in done.stderr
    _assert_stalls_below_sync_saves(out)
    assert f"local root: {root}" in out and "S3 replica: s3://" in out
    assert "Traceback" not in done.stderr
    # What the demo says is on disk is there: the two newest, committed and sound.
    assert [i.name for i in dcp_safe.list_checkpoints(root)] == ["step_000008", "step_000012"]
    assert dcp_safe.verify_checkpoint(root, "latest").name == "step_000012"


@pytest.mark.s3
def test_demo_replicates_to_the_remote_it_is_given(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    root = tmp_path / "root"
    status = main(
        [
            "demo", "--root", str(root), "--remote", s3_root,
            "--storage-options", json.dumps(s3_options), "--steps", "2", "--save-every", "1",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == EXIT_OK
    assert f"S3 replica: {s3_root} (as given)" in out
    assert "restore of step_000002 from S3 alone: PASSED" in out
    remote = dcp_safe.list_checkpoints(s3_root, storage_options=s3_options)
    assert [i.name for i in remote] == ["step_000001", "step_000002"]


def _assert_stalls_below_sync_saves(out: str) -> None:
    """After the first, the async saves stall training less than a synchronous save of the
    same state (their medians: one save of a loaded host is noise), and the headline says how
    its two figures compare in words that fit them."""
    pairs = [
        (float(a), float(s))
        for a, s in re.findall(r"training stall +([\d.]+) ms async vs +([\d.]+) ms sync", out)
    ]
    assert len(pairs) == 3, out
    later = pairs[1:]
    assert statistics.median(a for a, _ in later) < statistics.median(s for _, s in later), out
    found = re.search(
        r"median of \d+ saves: (\d+) ms async vs (\d+) ms for a synchronous save"
        r" \((?:([\d.]+)x (less|more)|the same)\)",
        out,
    )
    assert found is not None, out
    stall, sync = int(found[1]), int(found[2])  # rounded: equal figures may still differ
    if stall != sync:
        assert found[4] == ("less" if stall < sync else "more"), out
    assert found[3] is None or float(found[3]) >= 1.0, out
