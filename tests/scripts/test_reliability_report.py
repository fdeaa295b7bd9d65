"""scripts/reliability_report.py: runs the suites through pytest and adds up their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "reliability_report.py"

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(600)]
# Running the script starts a second pytest (and torch): ~15 s on an idle machine, so the run
# itself is in the long mode; the default run checks how the figures are added up.


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DCP_SAFE_LONG") != "1", reason="set DCP_SAFE_LONG=1")
def test_quick_run_reports_the_truncation_figures_and_exits_clean(tmp_path: Path) -> None:
    out = tmp_path / "totals.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--suites",
            "corruption",
            "-k",
            "random_truncation",
            "--json",
            str(out),
        ],
        cwd=REPO,
        # The default run of the suite, whatever mode this test itself runs in.
        env={k: v for k, v in os.environ.items() if k != "DCP_SAFE_LONG"},
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "truncations detected        24 / 24" in done.stdout
    assert done.stdout.rstrip().endswith("CLEAN")
    totals = json.loads(out.read_text())
    assert (totals["cuts_tried"], totals["cuts_detected"], totals["clean"]) == (24, 24, True)


def test_a_recorded_corrupt_publish_makes_the_report_not_clean() -> None:
    script = load_script(SCRIPT)
    lines = [
        json.dumps(
            {
                "kind": "crash",
                "suite": "s",
                "kill_points": 10,
                "corrupt_publishes": 0,
                "last_good_losses": 0,
            }
        ),
        json.dumps(
            {
                "kind": "flips",
                "variant": "none",
                "tried": 5,
                "detected_by_verify": 5,
                "unnamed": 0,
                "accepted_by_load": 0,
            }
        ),
    ]
    assert script.read_figures(lines).clean
    bad = [
        *lines,
        json.dumps(
            {
                "kind": "crash",
                "suite": "t",
                "kill_points": 3,
                "corrupt_publishes": 1,
                "last_good_losses": 0,
            }
        ),
    ]
    totals = script.read_figures(bad)
    assert (totals.kill_points, totals.corrupt_publishes, totals.clean) == (13, 1, False)
    text = script.render(totals, long=False, pytest_status=0, wall_s=1.0)
    assert "fork kill points tried      13" in text and text.endswith("NOT CLEAN")
