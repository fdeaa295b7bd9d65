"""Memory during a load: peak host memory above the target state, with and without a budget.

Usage::

    .venv/bin/python benchmarks/bench_load_memory.py [--load-budget 16] [--rounds 3]
        [--tensors 16] [--tensor-mib 16] [--threads 8] [--dir D]

One float32 state (16 tensors of 16 MiB: 256 MiB) saved three times: by torch's
``FileSystemWriter`` and by ``SafeStorageWriter`` plain and zstd (8 files each). Each load runs
in a fresh subprocess that allocates its targets, loads a tiny checkpoint (imports and thread
pools in place), resets the peak-RSS mark (``/proc/self/clear_refs``) and reads ``VmHWM``
after the load: the growth is what the load held beyond its targets. Two kinds of target:
*direct* (contiguous CPU tensors of the stored shape, read straight into) and *copied*
(transposed views: every item is read into a tensor of the stored shape and copied, as into a
GPU or a resharded target). Contenders: torch's ``FileSystemReader`` (one thread: this torch's
reader takes no thread count), ``SafeStorageReader``
without a budget, and with ``--load-budget`` MiB. Medians over ``--rounds``; every load is
checked for exact values. Results: ``benchmarks/results/bench_load_memory-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, median, write_results

from dcp_safe import SafeStorageWriter, WriterOptions

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
COLS = 1024

_CHILD = """
import json, sys, time
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from dcp_safe import SafeStorageReader

def status_kib(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field + ":")).split()[1])

kind, root, tiny, tensors, rows, threads, budget, copied = sys.argv[1:9]
tensors, rows, threads, budget = int(tensors), int(rows), int(threads), int(budget) or None
cols = 1024
def load(target, where):
    if kind == "torch":
        dcp.load(target, storage_reader=FileSystemReader(where), no_dist=True)
        return 0
    reader = SafeStorageReader(where, thread_count=threads, load_budget_bytes=budget)
    dcp.load(target, storage_reader=reader, checkpoint_id="step_1", no_dist=True)
    return reader.memory_stats().peak_bytes
load({"w": torch.zeros(1000)}, tiny)
make = (lambda: torch.ones(cols, rows).t()) if copied == "1" else (lambda: torch.ones(rows, cols))
target = {f"layers.{i:02d}": make() for i in range(tensors)}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status_kib("VmRSS")
start = time.perf_counter()
counted = load(target, root)
seconds = time.perf_counter() - start
growth = (status_kib("VmHWM") - before) * 1024
gen = torch.Generator().manual_seed(0)
exact = all(torch.equal(target[f"layers.{i:02d}"], torch.randn(rows, cols, generator=gen))
            for i in range(tensors))
print(json.dumps({"growth_bytes": growth, "seconds": seconds, "counted_bytes": counted,
                  "exact": exact}))
"""


def _save_all(base: Path, tensors: int, rows: int, threads: int) -> dict[str, tuple[Path, Path]]:
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i:02d}": torch.randn(rows, COLS, generator=gen) for i in range(tensors)}
    tiny = {"w": torch.randn(1000, generator=gen)}
    roots: dict[str, tuple[Path, Path]] = {}
    for name, compression in (("plain", "none"), ("zstd", "zstd")):
        for label, what in (("root", state), ("tiny", tiny)):
            writer = SafeStorageWriter(
                base / f"{name}-{label}",
                options=WriterOptions(compression=compression, thread_count=threads),
            )
            dcp.save(what, storage_writer=writer, checkpoint_id="step_1", no_dist=True)
        roots[name] = (base / f"{name}-root", base / f"{name}-tiny")
    for label, what in (("root", state), ("tiny", tiny)):
        writer = FileSystemWriter(base / f"torch-{label}", thread_count=threads)
        dcp.save(what, storage_writer=writer, no_dist=True)
    roots["torch"] = (base / "torch-root", base / "torch-tiny")
    return roots


def _child(
    kind: str, roots: tuple[Path, Path], args: argparse.Namespace, budget: int, copied: bool
) -> dict[str, Any]:
    rows = args.tensor_mib * MIB // 4 // COLS
    argv = [kind, *map(str, roots), str(args.tensors), str(rows), str(args.threads)]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv, str(budget), "1" if copied else "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not report["exact"]:
        raise AssertionError(f"{kind}: the load differs from the save")
    return report


def run(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    rows = args.tensor_mib * MIB // 4 // COLS
    roots = _save_all(base, args.tensors, rows, args.threads)
    budget = args.load_budget * MIB
    cases = [
        ("torch FileSystemReader", "torch", "torch", 0),
        ("dcp_safe, no budget", "dcp_safe", "plain", 0),
        (f"dcp_safe, {args.load_budget} MiB budget", "dcp_safe", "plain", budget),
        ("dcp_safe zstd, no budget", "dcp_safe", "zstd", 0),
        (f"dcp_safe zstd, {args.load_budget} MiB budget", "dcp_safe", "zstd", budget),
    ]
    rows_out = []
    for copied in (False, True):
        for label, kind, root, case_budget in cases:
            runs = [
                _child(kind, roots[root], args, case_budget, copied) for _ in range(args.rounds)
            ]
            rows_out.append(
                {
                    "targets": "copied" if copied else "direct",
                    "contender": label,
                    "growth_mib": median(r["growth_bytes"] / MIB for r in runs),
                    "counted_mib": median(r["counted_bytes"] / MIB for r in runs),
                    "seconds": median(r["seconds"] for r in runs),
                }
            )
    return {"args": vars(args), "rows": rows_out}


def report(results: dict[str, Any]) -> str:
    table = [
        (
            r["targets"],
            r["contender"],
            f"{r['growth_mib']:.0f}",
            f"{r['counted_mib']:.1f}" if r["contender"].startswith("dcp_safe") else "-",
            f"{r['seconds']:.2f}",
        )
        for r in results["rows"]
    ]
    headers = ["targets", "reader", "peak RSS growth MiB", "counted MiB", "load s"]
    return markdown_table(headers, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-budget", type=int, default=16, help="MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        results = run(args, Path(folder))
    print(report(results))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(f"results: {write_results(RESULTS / f'bench_load_memory-{stamp}.json', results)}")


if __name__ == "__main__":
    main()
