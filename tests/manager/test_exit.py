"""A manager left open drains at interpreter exit, before the interpreter stops its thread pools.

Its at-exit drain ran from ``atexit``, after the interpreter had already shut down every thread
pool: the save in flight could not schedule its writes and failed, the drain waited for it
until its timeout, and a traceback was printed. Now the drain runs when the main thread ends,
before those pools stop: the save commits, and nothing is printed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dcp_safe

pytestmark = pytest.mark.subprocess

# Generous: only a guard against a hung subprocess, never a measure of speed.
_TIMEOUT_S = 600

_SCRIPT = """
import sys
import torch
from dcp_safe import CheckpointManager

manager = CheckpointManager(sys.argv[1], keep_last=2)
manager.save(1, {"w": torch.arange(1024, dtype=torch.float32)})
print("leaving without close", flush=True)
"""


def test_an_unclosed_manager_commits_its_save_at_exit_without_a_traceback(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(_SCRIPT), str(root)],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "failed" not in run.stderr, run.stderr
    assert [info.name for info in dcp_safe.list_checkpoints(root)] == ["step_000000001"]
