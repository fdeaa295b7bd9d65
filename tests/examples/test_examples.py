"""Every example in examples/ runs to completion and reports success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_covered_by_a_test(example: str) -> None:
    tested = {"quickstart.py", "slow_storage_report.py"}
    assert example in tested, f"{example} has no test: add one to this module"
