"""Export's memory bound, measured: peak RSS grows by at most the largest tensor + 64 MiB.

The export runs in a fresh subprocess that first exports a tiny checkpoint (so imports, thread
pools and torch's allocator caches are in place), then resets the kernel's peak-RSS mark to
the current RSS (``/proc/self/clear_refs``), exports a checkpoint of four 64 MiB tensors
(256 MiB in all), and reads the peak (``VmHWM``) again. A memory bound, not a time threshold.

Why not ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries it across ``fork`` and
``execve``, so the child starts with the pytest process's peak (measured here: 620 MiB, right
after the fixture saved the 256 MiB state) and an export below it reads as no growth or, taken
from the current RSS, as 270 MiB. It is reported too, for reference.

An export that held the whole state would grow by at least 256 MiB; the bound is 128 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions
from dcp_safe.exporting.consolidate import BATCH_BYTES

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

TENSOR_BYTES = 64 << 20
TENSORS = 4
# Generous: only a guard against a hung subprocess, never a measure of speed.
_TIMEOUT_S = 400

_CHILD = """
import json, os, resource, sys
from dcp_safe.exporting import export

def status_kib(field):
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])

root, tiny, dest, fmt, dtype = sys.argv[1:6]
export(tiny, "latest", dest + "_warm", format=fmt, dtype=dtype or None)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak-RSS mark (VmHWM) starts again from the current RSS
before = status_kib("VmRSS")
result = export(root, "latest", dest, format=fmt, dtype=dtype or None)
peak = status_kib("VmHWM")
print(json.dumps({"growth_kib": peak - before, "rss_before_kib": before, "peak_kib": peak,
                  "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "tensor_bytes": result.tensor_bytes}))
"""


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("memory")
    gen = torch.Generator().manual_seed(0)
    state = {
        f"layers.{i}.weight": torch.randn(TENSOR_BYTES // 4, generator=gen).view(4096, -1)
        for i in range(TENSORS)
    }
    state["layers.norm"] = torch.randn(4096, generator=gen)
    state["meta"] = {"step": 1}
    writer = SafeStorageWriter(base / "root", options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(state, checkpoint_id="step_0001", storage_writer=writer)
    del state
    tiny = {"w": torch.randn(1000, generator=gen), "meta": {"step": 1}}
    writer = SafeStorageWriter(base / "tiny", options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(tiny, checkpoint_id="step_0001", storage_writer=writer)
    return base / "root", base / "tiny"


@pytest.mark.parametrize(("fmt", "dtype"), [("safetensors", ""), ("torch", "bfloat16")])
def test_peak_rss_grows_by_at_most_the_largest_tensor_plus_the_batch(
    roots: tuple[Path, Path], tmp_path: Path, fmt: str, dtype: str
) -> None:
    root, tiny = roots
    dest = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(tiny), str(dest), fmt, dtype],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tensor_bytes"] >= TENSORS * TENSOR_BYTES // (2 if dtype else 1)
    growth = report["growth_kib"] * 1024
    assert growth <= TENSOR_BYTES + BATCH_BYTES, report
    assert (dest / "SHA256SUMS").is_file()
