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
    assert "no checkpoint yet: starting at step 0" in first
    saved = dict(re.findall(r"saving (step_\d+) \(state digest (\w+)\)", first))
    assert sorted(saved) == ["step_000000002", "step_000000004", "step_000000006"]
    # The manager's retention keeps the newest two (--keep-last 2), on both roots.
    names = [info.name for info in dcp_safe.list_checkpoints(root)]
    assert names == ["step_000000004", "step_000000006"]
    assert "step_000000006" in [info.name for info in dcp_safe.list_checkpoints(replica)]
    assert f"replicated step_000000006 to {replica}" in first
    assert "saves: requested 3, committed 3, skipped 0" in first
    uninterrupted = re.findall(r"done at step 6 \(state digest (\w+)\)", first)
    assert uninterrupted == [saved["step_000000006"]]

    # As if the job died after step 6's training but before its checkpoint committed.
    shutil.rmtree(root / "step_000000006")
    second = _torchrun("train_fsdp.py", *train, cwd=tmp_path)

    # It loaded step 4 exactly as saved (full tensors of model and Adam state, gathered) ...
    assert (
        f"resumed from step_000000004 at step 4 (state digest {saved['step_000000004']})" in second
    )
    assert "step 2:" not in second
    # ... and steps 5-6 ended bit for bit where the uninterrupted run did.
    assert re.findall(r"done at step 6 \(state digest (\w+)\)", second) == uninterrupted
    report = dcp_safe.verify_checkpoint(root, "step_000000006")
    assert report.name == "step_000000006"
    assert [info.world_size for info in dcp_safe.list_checkpoints(root)] == [2, 2]


@pytest.mark.multiproc
def test_train_fsdp_skips_saves_while_slow_storage_is_busy_and_keeps_the_final_state(
    tmp_path: Path,
) -> None:
    # Every item written sleeps 20 ms: a save takes far longer than one step.
    slow = ["--when-busy", "skip", "--slow-write-ms", "20"]
    args = ["--root", str(tmp_path / "ckpt"), "--steps", "8", "--save-every", "1", *slow]
    out = _torchrun("train_fsdp.py", *args, cwd=tmp_path)

    skipped_steps = re.findall(r"step (\d+): loss \S+, save skipped \(busy", out)
    counts = re.search(r"saves: requested (\d+), committed (\d+), skipped (\d+)", out)
    assert counts is not None, out
    requested, committed, skipped = map(int, counts.groups())
    assert skipped == len(skipped_steps) >= 1
    assert requested == committed + skipped  # the ranks agreed on every request
    # The final step is saved even if its request was skipped (a forced save).
    last = re.findall(r"(?:saving|final save) (step_\d+) \(state digest (\w+)\)", out)[-1]
    assert last[0] == "step_000000008"
    assert re.findall(r"done at step 8 \(state digest (\w+)\)", out) == [last[1]]
    assert f"committed {last[0]}" in out
    # One memory line per rank, each within its share of the node's staging envelope.
    ranks = re.findall(r"rank (\d): peak staging pool .*share 0\.5 .* within = True; peak RSS", out)
    assert ranks == ["0", "1"]


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_covered_by_a_test(example: str) -> None:
    tested = {"quickstart.py", "slow_storage_report.py", "train_fsdp.py"}
    assert example in tested, f"{example} has no test: add one to this module"
