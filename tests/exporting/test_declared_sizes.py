"""``dcp-safe export`` allocates nothing a checkpoint's files do not hold (issue 43, 11).

The checkpoint is 2 KiB on disk; its manifest (re-checksummed, the marker rewritten, as a root
writer can) says its one item is far longer, and, in the second case, that the tensor it holds
has a shape to match. Export used to allocate the declared tensor and the item's bytes before
the short read (a raw ``RuntimeError`` and a traceback past what ``torch.empty`` can make).
The command runs in a fresh subprocess (``dcp_safe.cli.main``, what the ``dcp-safe`` script
calls) whose peak RSS (``VmHWM``, reset after the imports) is compared with the claim: a memory
bound, not a time threshold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import claim_item_length

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

NAME = "step_0000000001"
MEASURED = 2 << 30  # what the claims below come to, where RSS is measured

_CHILD = """
import json, sys
import torch
from dcp_safe.cli import main

def kib(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field + ":")).split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak-RSS mark starts again from here
before = kib("VmRSS")
status = main(sys.argv[1:])
print(json.dumps({"growth_kib": kib("VmHWM") - before, "status": status}))
"""


@pytest.mark.parametrize(
    ("rows", "length"),
    [
        (None, MEASURED),  # the item's length only
        (MEASURED // 32, MEASURED + 4096),  # the shape too: 2 GiB of float32
        (1 << 50, 1 << 60),  # past what torch.empty can allocate
    ],
)
def test_a_claimed_item_or_shape_is_refused_before_it_is_allocated(
    tmp_path: Path, rows: int | None, length: int
) -> None:
    root = tmp_path / "root"
    claim_item_length(root, NAME, length, rows)
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) < 16 << 10
    dest = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, "export", str(root), "latest", str(dest)],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["status"] != 0
    assert "dcp-safe: error: CORRUPT:" in done.stderr
    assert "file is shorter than the manifest says" in done.stderr, done.stderr
    assert found["growth_kib"] * 1024 < MEASURED // 8, found
    assert not dest.exists()
