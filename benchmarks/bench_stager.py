"""Training stall, host allocation and peak RSS of async-save staging: BudgetedStager vs DCP.

Run: ``python benchmarks/bench_stager.py --size-gib 1``. Each (variant, state) pair runs in its
own subprocess so peak RSS and allocation figures do not leak between variants. For each it
measures, in one run, the 1st and 2nd save's training stall (``async_save`` call to
``staging_completion``), host bytes allocated per save and peak RSS (psutil, sampled every
5 ms). Prints a markdown table and writes JSON to ``benchmarks/results/`` (git-ignored).

Many small tensors: ``python benchmarks/bench_stager.py --count 4096,10000 --tensor-kib 32``
runs, in one process, ``BudgetedStager`` against DCP's ``DefaultStager`` (CPU options: no pinning,
no shared memory, async staging) and the copy floor, on ``{"model": {fqn: tensor}}`` states of
``count`` float32 tensors (``--flat`` puts the fqns at the top level instead). Each contender's
first save is untimed; then every round saves once per contender, order rotated, and times the
*second-save stall*: from the ``dcp.async_save`` call until ``staging_completion`` resolves (the
training loop may mutate the state again), with reusable buffers in place. Reports medians and
the median of per-round ratios.

Variants:
    floor            bare ``copy_`` into preallocated, first-touched buffers (no DCP)
    budgeted         BudgetedStager, cold pool
    budgeted_warm    BudgetedStager after ``warm_up(state)``
    budgeted_shared  BudgetedStager(shared_memory=True) after ``warm_up``: buffers in memfd slabs,
                     as the manager's ``executor="process"`` stages (issue #30's target: its
                     stall within 1.1x of the copy floor)
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_safe.bench.measure import RssSampler
from dcp_safe.units import format_size

VARIANTS = [
    "floor",
    "budgeted",
    "budgeted_warm",
    "budgeted_shared",
    "default_stager",
    "async_save",
    "blocking_cached",
]
STATES = ["large", "small"]


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

    from dcp_safe.staging import BudgetedStager, StagerOptions

    state = make_state(kind, size_gib)
    staged_bytes = sum(t.nbytes for t in _tensors(state))
    sampler = RssSampler().start()
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
                shared = variant == "budgeted_shared"
                stager = BudgetedStager(
                    options=StagerOptions(pin_memory="off"), shared_memory=shared
                )
                if variant in ("budgeted_warm", "budgeted_shared"):
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
    return "-" if n is None else format_size(n)


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


def many_state(count: int, tensor_kib: int, flat: bool) -> dict[str, Any]:
    import torch

    numel = tensor_kib * 1024 // 4
    model = {f"layers.{i}.weight": torch.randn(numel) for i in range(count)}
    return model if flat else {"model": model, "step": 0}


def run_many(count: int, tensor_kib: int, rounds: int, flat: bool) -> dict[str, Any]:
    """Second-save stall of each stager on ``count`` small tensors, rotated per round."""
    import gc

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_safe.bench.measure import median, rotate
    from dcp_safe.staging import BudgetedStager, StagerOptions

    state = many_state(count, tensor_kib, flat)
    sources = _tensors(state)
    floor_buffers = [torch.empty_like(t).zero_() for t in sources]
    stagers: dict[str, Any] = {
        "budgeted": BudgetedStager(options=StagerOptions(pin_memory="off")),
        "budgeted_shared": BudgetedStager(
            options=StagerOptions(pin_memory="off"), shared_memory=True
        ),
        "default_stager": DefaultStager(StagingOptions(False, False, True, False)),
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench_stager_many_"))
    saves = 0

    def save(name: str) -> float:
        nonlocal saves
        saves += 1
        stager = stagers[name]
        writer = FileSystemWriter(str(workdir / f"c{saves}"), sync_files=False)
        gc.collect()
        start = time.perf_counter()
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
        response.staging_completion.result()
        stall = time.perf_counter() - start
        if isinstance(stager, BudgetedStager):
            stager.track(response)  # released when the upload ends, as stager.async_save does
        response.upload_completion.result()
        shutil.rmtree(workdir / f"c{saves}", ignore_errors=True)
        return stall

    def floor() -> float:
        gc.collect()
        start = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(floor_buffers, sources, strict=True):
                dst.copy_(src)
        return time.perf_counter() - start

    contenders = {"floor": floor, **{name: (lambda n=name: save(n)) for name in stagers}}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    first = {name: fn() for name, fn in contenders.items()}  # cold: buffers allocated here
    try:
        for round_ in range(rounds):
            for name in rotate(list(contenders), round_):
                times[name].append(contenders[name]())
    finally:
        for stager in stagers.values():
            stager.close()
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = [b / d for b, d in zip(times["budgeted"], times["default_stager"], strict=True)]
    return {
        "count": count,
        "tensor_kib": tensor_kib,
        "flat": flat,
        "bytes": sum(t.nbytes for t in sources),
        "rounds": rounds,
        "first_s": first,
        "times_s": times,
        "median_s": {name: median(v) for name, v in times.items()},
        "budgeted_over_default_median": median(times["budgeted"]) / median(times["default_stager"]),
        "budgeted_over_default_per_round_median": median(ratios),
        "budgeted_over_floor": median(times["budgeted"]) / median(times["floor"]),
        "shared_over_floor": median(times["budgeted_shared"]) / median(times["floor"]),
        "shared_over_budgeted": median(times["budgeted_shared"]) / median(times["budgeted"]),
    }


def many_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| state | floor (ms) | BudgetedStager 2nd stall (ms) | DefaultStager 2nd stall (ms)"
        " | Budgeted / Default (medians) | per-round median | Budgeted / floor"
        " | shared slabs 2nd stall (ms) | shared / floor | shared / Budgeted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["median_s"]
        layout = "flat" if r["flat"] else "nested"
        lines.append(
            f"| {r['count']:,} x {r['tensor_kib']} KiB ({_fmt_b(r['bytes'])}, {layout})"
            f" | {m['floor'] * 1e3:.1f} | {m['budgeted'] * 1e3:.1f}"
            f" | {m['default_stager'] * 1e3:.1f} | {r['budgeted_over_default_median']:.2f}x"
            f" | {r['budgeted_over_default_per_round_median']:.2f}x"
            f" | {r['budgeted_over_floor']:.2f}x | {m['budgeted_shared'] * 1e3:.1f}"
            f" | {r['shared_over_floor']:.2f}x | {r['shared_over_budgeted']:.2f}x |"
        )
    return "\n".join(lines)


def main_many(args: argparse.Namespace) -> int:
    rows = []
    for count in (int(c) for c in args.count.split(",")):
        rows.append(run_many(count, args.tensor_kib, args.rounds, args.flat))
        print(f"done: {count} tensors", file=sys.stderr)
    print(many_table(rows))
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"bench_stager_many-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2))
    print(f"\nJSON: {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--count", help="many-small-tensors mode: tensor counts, e.g. 4096,10000")
    parser.add_argument("--tensor-kib", type=int, default=32, help="size of each tensor (--count)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (--count)")
    parser.add_argument("--flat", action="store_true", help="fqns at the top level (--count)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "STATE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count:
        return main_many(args)
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
