"""Every example in examples/ runs to completion and reports success."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dcp_safe

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_quickstart_saves_lists_verifies_and_loads(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "parameters identical = True" in result.stdout
    assert "verified step_000003" in result.stdout


def test_slow_storage_report_never_queues_and_stays_within_the_envelope(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "slow_storage_report.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "requested cuts: 40" in result.stdout
    assert "RSS growth within envelope = True" in result.stdout


def _torchrun(script: str, *args: str, cwd: Path) -> str:
    """Run an example on two local ranks with torchrun; return rank 0's output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    result = subprocess.run(
        [*command, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.multiproc
def test_train_fsdp_resumes_from_its_latest_checkpoint_exactly_where_it_left_off(
    tmp_path: Path,
) -> None:
    root, replica = tmp_path / "ckpt", tmp_path / "replica"
    train = ["--root", str(root), "--steps", "6", "--save-every", "2"]
    first = _torchrun("train_fsdp.py", *train, "--replicate-to", str(replica), cwd=tmp_path)
    saved = dict(re.findall(r"saving (step_\d+) \(state digest (\w+)\)", first))
    assert sorted(saved) == ["step_000002", "step_000004", "step_000006"]
    names = [info.name for info in dcp_safe.list_checkpoints(root)]
    assert names == sorted(saved)
    assert "step_000006" in [info.name for info in dcp_safe.list_checkpoints(replica)]
    uninterrupted = re.findall(r"done at step 6 \(state digest (\w+)\)", first)
    assert uninterrupted == [saved["step_000006"]]

    # As if the job died after step 6's training but before its checkpoint committed.
    shutil.rmtree(root / "step_000006")
    second = _torchrun("train_fsdp.py", *train, cwd=tmp_path)

    # It loaded step 4 exactly as saved (full tensors of model and Adam state, gathered) ...
    assert f"resumed from step_000004 at step 4 (state digest {saved['step_000004']})" in second
    assert "step 2:" not in second
    # ... and steps 5-6 ended bit for bit where the uninterrupted run did.
    assert re.findall(r"done at step 6 \(state digest (\w+)\)", second) == uninterrupted
    report = dcp_safe.verify_checkpoint(root, "step_000006")
    assert report.name == "step_000006"
    assert [info.world_size for info in dcp_safe.list_checkpoints(root)] == [2, 2, 2]


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_covered_by_a_test(example: str) -> None:
    tested = {"quickstart.py", "slow_storage_report.py", "train_fsdp.py"}
    assert example in tested, f"{example} has no test: add one to this module"
