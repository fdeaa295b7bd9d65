"""A load allocates nothing for an item before its file is known to hold it (issue 43, 11).

The checkpoint is 2 KiB on disk; its manifest (re-checksummed, the marker rewritten, as a root
writer can) says its one item is 2 GiB long. Loads used to allocate those 2 GiB (touched: a
zero-filled ``bytearray``) before the short read refused the item, on every restore, and a
larger claim became a ``MemoryError``. Each entry point runs in a fresh subprocess whose peak
RSS (``VmHWM``, reset after the imports) is compared with the claim: a memory bound, not a
time threshold (see ``tests/exporting/test_memory.py`` for why not ``ru_maxrss``).
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
DECLARED = 2 << 30

_CHILD = """
import json, sys, torch
import dcp_safe

def kib(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field + ":")).split()[1])

root, how = sys.argv[1:3]
target = {"w": torch.zeros(16, 8)}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak-RSS mark starts again from here
before = kib("VmRSS")
try:
    if how == "load":
        reader = dcp_safe.SafeStorageReader(root)
        dcp_safe.load(target, checkpoint_id="latest", storage_reader=reader)
    else:
        with dcp_safe.CheckpointManager(root) as manager:
            manager.restore(target)
    error = None
except Exception as exc:
    error = [type(exc).__name__, str(exc), type(exc.__cause__).__name__]
print(json.dumps({"growth_kib": kib("VmHWM") - before, "error": error}))
"""


@pytest.mark.parametrize("how", ["load", "restore"])
def test_an_item_longer_than_its_file_is_refused_before_anything_is_allocated(
    tmp_path: Path, how: str
) -> None:
    root = tmp_path / "root"
    claim_item_length(root, NAME, DECLARED)
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) < 16 << 10
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), how],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["growth_kib"] * 1024 < DECLARED // 8, found
    kind, message, cause = found["error"]
    assert "file is shorter than the manifest says" in message, found
    assert "CheckpointCorruptError" in (kind, cause), found
