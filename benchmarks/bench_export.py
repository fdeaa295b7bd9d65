"""Export: time and peak RSS of ``dcp_safe.export`` against ``torch.save`` of the same state.

Usage::

    .venv/bin/python benchmarks/bench_export.py [--rounds 3] [--sizes-mib 256,1024]
        [--tensors 8] [--dir D]

For each size, one checkpoint of ``--tensors`` float32 tensors (``SafeStorageWriter``), then
``--rounds`` rounds, the contenders' order rotated per round, each contender in a fresh
subprocess (so its peak RSS is its own):

* ``export safetensors`` and ``export torch``: ``dcp_safe.export`` (verified reads, streamed
  writes, fsync, SHA256SUMS, atomic publish);
* ``torch.save``: the same state, already in memory (built before the clock starts, but
  counted in the peak: torch.save needs it there), saved to one file and fsynced;
* ``dcp_to_torch_save``: stock DCP's own consolidation (``torch.distributed.checkpoint
  .format_utils``: load the whole checkpoint unverified, then ``torch.save``), fsynced.

Peak RSS growth is the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` once imports are done) minus the RSS at that moment. Medians; time
ratios against ``torch.save``. Results: ``benchmarks/results/bench_export-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    format_size,
    markdown_table,
    median,
    rotate,
    run_and_report,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
NAME = "step_0001"
CONTENDERS = ["export safetensors", "export torch", "torch.save", "dcp_to_torch_save"]
BASELINE = "torch.save"


def make_state(total_bytes: int, count: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    numel = max(1, total_bytes // 4 // count)
    return {f"layers.{i:03d}.weight": torch.randn(numel, generator=gen) for i in range(count)}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _save_fsynced(state: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def worker(contender: str, root: Path, dest: Path, total_bytes: int, count: int) -> dict[str, Any]:
    """One contender, once, in this (fresh) process: seconds and peak RSS growth."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import dcp_safe

    state = None
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM starts again from the current RSS
    before = _status_bytes("VmRSS")
    if contender == "torch.save":
        state = make_state(total_bytes, count)  # in the peak, not on the clock
    dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if contender == "export safetensors":
        dcp_safe.export(root, NAME, dest / "out")
    elif contender == "export torch":
        dcp_safe.export(root, NAME, dest / "out", format="torch")
    elif contender == "torch.save":
        _save_fsynced(state, dest / "model.pt")
    else:
        dcp_to_torch_save(root / NAME, dest / "model.pt")
        with open(dest / "model.pt", "rb+") as f:
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "growth_bytes": _status_bytes("VmHWM") - before}


def _run_worker(contender: str, root: Path, dest: Path, total: int, count: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--worker", contender, str(root), str(dest)]
    argv += [str(total), str(count)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{done.stderr}")
    shutil.rmtree(dest, ignore_errors=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(work: Path, size_mib: int, count: int, rounds: int) -> dict[str, Any]:
    import dcp_safe

    total = size_mib * MIB
    root = work / f"root_{size_mib}"
    dcp_safe.save(
        make_state(total, count),
        checkpoint_id=NAME,
        storage_writer=dcp_safe.SafeStorageWriter(root, step=1),
    )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for round_ in range(rounds):
        for contender in rotate(CONTENDERS, round_):
            dest = work / f"dest_{round_}"
            runs[contender].append(_run_worker(contender, root, dest, total, count))
    shutil.rmtree(root, ignore_errors=True)
    med = {
        c: {key: median([r[key] for r in rs]) for key in ("seconds", "growth_bytes")}
        for c, rs in runs.items()
    }
    largest = total // count
    baseline = med[BASELINE]["seconds"]
    return {
        "label": f"{size_mib} MiB in {count} tensors",
        "checkpoint_bytes": total,
        "largest_tensor_bytes": largest,
        "median": med,
        "time_over_torch_save": {c: m["seconds"] / baseline for c, m in med.items()},
        "growth_over_largest_tensor": {c: m["growth_bytes"] / largest for c, m in med.items()},
        "rounds": rounds,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    rows = [measure(work, size, args.tensors, args.rounds) for size in args.sizes]
    return {"machine": describe_machine(str(work)), "torch": torch.__version__, "rows": rows}


def report(results: dict[str, Any]) -> str:
    lines = []
    for row in results["rows"]:
        for contender in CONTENDERS:
            m = row["median"][contender]
            lines.append(
                [
                    row["label"],
                    contender,
                    f"{m['seconds']:.2f}",
                    f"{row['time_over_torch_save'][contender]:.2f}",
                    format_size(m["growth_bytes"]),
                    f"{row['growth_over_largest_tensor'][contender]:.2f}",
                    f"{m['growth_bytes'] / row['checkpoint_bytes']:.2f}",
                ]
            )
    headers = [
        "checkpoint",
        "contender",
        "time s",
        "time / torch.save",
        "peak RSS growth",
        "growth / largest tensor",
        "growth / checkpoint",
    ]
    return markdown_table(headers, lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        contender, root, dest, total, count = argv[1:6]
        result = worker(contender, Path(root), Path(dest), int(total), int(count))
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender")
    parser.add_argument("--sizes-mib", dest="sizes", type=_ints, default=[256, 1024])
    parser.add_argument("--tensors", type=int, default=8, help="tensors per checkpoint")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_export_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_export-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
