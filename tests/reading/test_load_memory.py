"""A load's budget, measured as the process's memory: peak RSS above the target state.

Each load runs in a fresh subprocess that allocates (and touches) its targets, loads a tiny
checkpoint first (imports, thread pools in place), resets the kernel's peak-RSS mark to the
current RSS (``/proc/self/clear_refs``), loads 256 MiB (16 tensors of 16 MiB in 8 files, on
8 threads) and reads the peak (``VmHWM``) again. The targets are transposed views, so every
item is read into a tensor of the stored shape and copied (as into a GPU or a resharded
target): without a budget the 8 threads hold 8 such tensors at once, ~128 MiB.

With a 16 MiB budget the growth must stay within the larger of the budget and one item, plus
a fixed overhead of 48 MiB (measured: growth 35 MiB uncompressed, 51 MiB with zstd, against
136 and 156-163 MiB without a budget; the rest is thread stacks, zstd contexts, the small
reads): a memory bound, not a time threshold. Why not ``ru_maxrss``: see
tests/exporting/test_memory.py.
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
from dcp_safe.reading.tensors import STREAM_BYTES

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

MIB = 1 << 20
TENSORS, ROWS, COLS = 16, 4096, 1024  # 16 MiB of float32 each
BUDGET_BYTES = 16 * MIB
# One item, admitted alone when it exceeds the budget: its tensor, zstd's window and a read
# (uncompressed: the tensor and its framing), counted by the reader.
ITEM_BYTES = ROWS * COLS * 4 + STREAM_BYTES
OVERHEAD_BYTES = 48 * MIB
THREADS = 8
_TIMEOUT_S = 400  # a guard against a hung subprocess, never a measure of speed

_CHILD = """
import json, sys
import torch
import dcp_safe
from dcp_safe import SafeStorageReader

def status_kib(field):
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])

root, tiny, tensors, rows, cols, threads, budget = sys.argv[1:8]
tensors, rows, cols, threads = int(tensors), int(rows), int(cols), int(threads)
budget = int(budget) or None
def reader(where):
    return SafeStorageReader(where, thread_count=threads, load_budget_bytes=budget)
dcp_safe.load({"w": torch.zeros(1000)}, checkpoint_id="step_1", storage_reader=reader(tiny))
target = {f"layers.{i:02d}": torch.ones(cols, rows).t() for i in range(tensors)}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak-RSS mark (VmHWM) starts again from the current RSS
before = status_kib("VmRSS")
used = reader(root)
dcp_safe.load(target, checkpoint_id="step_1", storage_reader=used)
growth = (status_kib("VmHWM") - before) * 1024
gen = torch.Generator().manual_seed(0)
exact = all(
    torch.equal(target[f"layers.{i:02d}"], torch.randn(rows, cols, generator=gen))
    for i in range(tensors)
)
print(json.dumps({"growth_bytes": growth, "counted_peak_bytes": used.memory_stats().peak_bytes,
                  "exact": exact}))
"""


@pytest.fixture(scope="module", params=["none", "zstd"])
def roots(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp(f"load-memory-{request.param}")
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i:02d}": torch.randn(ROWS, COLS, generator=gen) for i in range(TENSORS)}
    options = WriterOptions(compression=request.param, thread_count=THREADS, fsync=False)
    dcp_safe.save(
        state,
        checkpoint_id="step_1",
        storage_writer=SafeStorageWriter(base / "root", options=options),
    )
    del state
    tiny = {"w": torch.randn(1000, generator=gen)}
    dcp_safe.save(
        tiny,
        checkpoint_id="step_1",
        storage_writer=SafeStorageWriter(base / "tiny", options=options),
    )
    return base / "root", base / "tiny"


def _load_in_a_subprocess(roots: tuple[Path, Path], budget: int | None) -> dict[str, int]:
    root, tiny = roots
    args = [
        str(root),
        str(tiny),
        str(TENSORS),
        str(ROWS),
        str(COLS),
        str(THREADS),
        str(budget or 0),
    ]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["exact"], report
    return report


def test_with_a_budget_the_peak_rss_grows_by_at_most_the_budget_plus_a_fixed_overhead(
    roots: tuple[Path, Path],
) -> None:
    bounded = _load_in_a_subprocess(roots, BUDGET_BYTES)
    unbounded = _load_in_a_subprocess(roots, None)  # reported, for reference
    assert bounded["counted_peak_bytes"] <= max(BUDGET_BYTES, ITEM_BYTES), bounded
    bound = max(BUDGET_BYTES, ITEM_BYTES) + OVERHEAD_BYTES
    assert bounded["growth_bytes"] <= bound, (bounded, unbounded)
