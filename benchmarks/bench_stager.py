"""Training stall, host allocation and peak RSS of async-save staging: BudgetedStager vs DCP.

Run: ``python benchmarks/bench_stager.py --size-gib 1``. Each (variant, state) pair runs in its
own subprocess so peak RSS and allocation figures do not leak between variants. For each it
measures, in one run, the 1st and 2nd save's training stall (``async_save`` call to
``staging_completion``), host bytes allocated per save and peak RSS (psutil, sampled every
5 ms). Prints a markdown table and writes JSON to ``benchmarks/results/`` (git-ignored).

Variants:
    floor            bare ``copy_`` into preallocated, first-touched buffers (no DCP)
    budgeted         BudgetedStager, cold pool
    budgeted_warm    BudgetedStager after ``warm_up(state)``
    default_stager   DCP ``DefaultStager`` with CPU options (async, no pinning, reuse by cache)
    async_save       DCP ``async_save`` with no stager (allocates a new copy every save)
    blocking_cached  DCP ``BlockingAsyncStager(cache_staged_state_dict=True)``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = [
    "floor",
    "budgeted",
    "budgeted_warm",
    "default_stager",
    "async_save",
    "blocking_cached",
]
STATES = ["large", "small"]
MiB = 1 << 20


class PeakRss:
    """Samples this process's RSS in a background thread."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(interval_s)

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def make_state(kind: str, size_gib: float) -> dict[str, Any]:
    import torch

    total = int(size_gib * (1 << 30))
    if kind == "large":
        n = 8
        return {f"layer{i}.weight": torch.randn(total // n // 4) for i in range(n)}
    # Many small tensors: a quarter of the size in 16 KiB tensors, plus scalars.
    n = max(1, total // 4 // (16 << 10))
    return {f"p{i}": {"w": torch.randn(4096), "step": i} for i in range(n)}


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def run_variant(variant: str, kind: str, size_gib: float) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import (
        BlockingAsyncStager,
        DefaultStager,
        StagingOptions,
    )

    from dcp_safe.staging import BudgetedStager

    state = make_state(kind, size_gib)
    staged_bytes = sum(t.nbytes for t in _tensors(state))
    sampler = PeakRss()
    rss_state = sampler.rss()
    out: dict[str, Any] = {
        "variant": variant,
        "state": kind,
        "tensors": len(_tensors(state)),
        "staged_bytes": staged_bytes,
        "rss_state": rss_state,
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench_stager_"))
    stager: Any = None
    try:
        if variant == "floor":
            buffers = [torch.empty_like(t).zero_() for t in _tensors(state)]
            for save in (1, 2):
                before = sampler.rss()
                t0 = time.perf_counter()
                for dst, src in zip(buffers, _tensors(state), strict=True):
                    dst.copy_(src)
                out[f"stall{save}_s"] = time.perf_counter() - t0
                out[f"alloc{save}_bytes"] = sampler.rss() - before
        else:
            if variant.startswith("budgeted"):
                stager = BudgetedStager(pin_memory="off")
                if variant == "budgeted_warm":
                    stager.warm_up(state)
            elif variant == "default_stager":
                stager = DefaultStager(StagingOptions(False, False, True, False))
            elif variant == "blocking_cached":
                stager = BlockingAsyncStager(cache_staged_state_dict=True)
            for save in (1, 2):
                before = sampler.rss()
                path = workdir / f"c{save}"
                t0 = time.perf_counter()
                response = dcp.async_save(
                    state,
                    storage_writer=FileSystemWriter(str(path), sync_files=False),
                    async_stager=stager,
                    no_dist=True,
                )
                if isinstance(response, dcp.state_dict_saver.AsyncSaveResponse):
                    response.staging_completion.result()
                    upload = response.upload_completion
                else:
                    upload = response
                out[f"stall{save}_s"] = time.perf_counter() - t0
                out[f"alloc{save}_bytes"] = sampler.rss() - before
                if isinstance(stager, BudgetedStager):
                    out[f"alloc{save}_bytes"] = stager.stats().last_allocated_bytes
                upload.result()
                shutil.rmtree(path, ignore_errors=True)
    except Exception as exc:  # report, do not hide, a variant that cannot run here
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        if stager is not None:
            try:
                stager.close()
            except Exception as exc:
                out.setdefault("error", f"close: {type(exc).__name__}: {exc}"[:200])
        shutil.rmtree(workdir, ignore_errors=True)
    out["peak_rss"] = sampler.stop()
    return out


def _fmt_b(n: Any) -> str:
    return "-" if n is None else f"{n / MiB:,.0f} MiB"


def _fmt_s(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    floors = {r["state"]: r.get("stall2_s") for r in rows if r["variant"] == "floor"}
    lines = [
        "| state | variant | stall 1st (s) | stall 2nd (s) | 2nd / floor | alloc 1st | alloc 2nd"
        " | peak RSS - state | (peak - state) / staged | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        floor = floors.get(r["state"])
        ratio = f"{r['stall2_s'] / floor:.2f}x" if floor and r.get("stall2_s") else "-"
        over = r["peak_rss"] - r["rss_state"]
        lines.append(
            f"| {r['state']} ({r['tensors']} t, {_fmt_b(r['staged_bytes'])}) | {r['variant']}"
            f" | {_fmt_s(r.get('stall1_s'))} | {_fmt_s(r.get('stall2_s'))} | {ratio}"
            f" | {_fmt_b(r.get('alloc1_bytes'))} | {_fmt_b(r.get('alloc2_bytes'))}"
            f" | {_fmt_b(over)} | {over / r['staged_bytes']:.2f} | {r.get('error', '')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "STATE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one[0], args.one[1], args.size_gib)))
        return 0
    rows = []
    for kind in args.states.split(","):
        for variant in args.variants.split(","):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--size-gib",
                    str(args.size_gib),
                    "--one",
                    variant,
                    kind,
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"done: {kind} {variant}", file=sys.stderr)
    print(table(rows))
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = results / f"bench_stager-{stamp}.json"
    meta = {"size_gib": args.size_gib, "cpus": os.cpu_count(), "rows": rows}
    path.write_text(json.dumps(meta, indent=2))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
