"""Coordinator time vs world size: rank 0's verify-and-publish for N simulated ranks.

Usage::

    .venv/bin/python benchmarks/bench_coordinator.py --world-sizes 8 64 512 4096 --rounds 3

No process group is needed: the outputs of N ranks are laid down on storage as
``SafeStorageWriter.write_data`` leaves them — each rank's shard file
(``__<rank>_0.distcp``, holding its items as DCP's own ``torch.save`` bytes) and its rank
manifest (``_ranks/rank_NNNNN.json``), written with the library's own types (``ItemRecord``,
``FileRecord``, ``RankManifest``) under the work folder the publish strategy names, behind the
strategy's own claim (the writing lease on S3) — together with DCP's global ``Metadata`` and the
per-rank ``WriteResult`` lists that DCP hands to ``finish`` (the first of each carrying the
rank's report, as the writer's does). What is timed is only what rank 0 does in ``finish``:
``Committer.publish`` (check every rank's report and results, size every rank manifest and
shard file from two listings, write ``.metadata``, ``manifest.json`` and ``_COMMITTED``,
publish).

Each simulated rank holds FSDP-style row shards of a few tensors, so the global ``.metadata``
and ``manifest.json`` grow with N as a real save's do (:mod:`dcp_safe.testing.world` lays them
down).

Two roots: a local folder (``LocalBackend``: rename publish, fsync) and a moto S3 server
(``dcp_safe.testing.s3.start_local_s3`` in a child process, as ``bench_s3.py`` runs it: marker
publish, every storage call a round trip). The rounds rotate the order of the world sizes; each
round lays down a fresh save (untimed) and times one publish. The medians, time per rank and
the ratio of each N's time per rank to the smallest N's (1.0 = perfectly linear) are printed as
a markdown table, saved to ``benchmarks/results/coordinator.json``, and drawn to
``docs/benchmarks/coordinator_vs_world_size.png`` (matplotlib, the ``bench`` extra).

On S3 each round also measures a request floor on the same server, right after laying the
save down: the two listings the coordinator makes (the work folder and ``_ranks/``, 1,000 keys
a page), paged through by plain boto3, the two at once. moto on a small machine is slow to
list, so the coordinator's time is best read as a ratio to that floor (``publish / floor``; the
coordinator also checks the lease and fence and writes three files).

Targets (#18): time growing linearly in N; 4,096 ranks published in at most 10 s on moto and
2 s locally.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.committer import DEFAULT_COMMIT_WORKERS
from dcp_safe.testing.world import ITEMS_PER_RANK, SimulatedSave, publish, simulate

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "coordinator.json"
DEFAULT_PLOT = REPO / "docs" / "benchmarks" / "coordinator_vs_world_size.png"
BUCKET = "bench-coordinator"
WORLD_SIZES = (8, 64, 512, 4096)
TARGET_S = {"local": 2.0, "s3": 10.0}  # at 4,096 ranks
LINEAR_SLACK = 2.0  # time per rank at the largest N over that at the smallest, at most


# ----------------------------------------------------------------------------- measuring


def measure_root(
    label: str,
    backend: Backend,
    world_sizes: Sequence[int],
    rounds: int,
    workers: Sequence[int],
    cleanup: Callable[[str], None],
    floor: Callable[[SimulatedSave], float] | None = None,
) -> dict[str, dict[str, Any]]:
    """Median publish time per worker count and world size on one root.

    Every (world size, workers) pair is one contender; their order rotates every round.
    ``floor``, if given, times the request floor for each laid-down save, before its publish.
    Returns ``{workers: {world size: summary}}``.
    """
    pairs = [(n, w) for n in world_sizes for w in workers]
    times: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    floors: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    for r in range(rounds):
        shift = r % len(pairs)
        for n, w in [*pairs[shift:], *pairs[:shift]]:
            name = f"ws{n}_w{w}_r{r}"
            setup_start = time.perf_counter()
            save = simulate(backend, name, n)
            setup_s = time.perf_counter() - setup_start
            shown = ""
            if floor is not None:
                floors[(n, w)].append(floor(save))
                shown = f"  floor {floors[(n, w)][-1]:7.3f} s"
            start = time.perf_counter()
            publish(backend, save, workers=w)
            elapsed = time.perf_counter() - start
            times[(n, w)].append(elapsed)
            print(
                f"  {label} round {r} N={n:5d} workers={w:3d}  publish {elapsed:7.3f} s{shown}"
                f"  (setup {setup_s:.1f} s)",
                flush=True,
            )
            cleanup(name)
    return {
        str(w): {str(n): _summary(n, times[(n, w)], floors[(n, w)]) for n in world_sizes}
        for w in workers
    }


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def _summary(
    world_size: int, samples: list[float], floors: list[float] | None = None
) -> dict[str, Any]:
    median = _median(samples)
    summary: dict[str, Any] = {
        "world_size": world_size,
        "samples_s": samples,
        "median_s": median,
        "min_s": min(samples),
        "per_rank_ms": 1000 * median / world_size,
    }
    if floors:
        summary["floor_samples_s"] = floors
        summary["floor_median_s"] = _median(floors)
        # Per round, so a burst of load on the machine moves both sides of the ratio.
        summary["over_floor"] = _median([t / f for t, f in zip(samples, floors, strict=True)])
    return summary


def get_floor(s3: Any, bucket: str, prefix: str, threads: int) -> Callable[[SimulatedSave], float]:
    """The request floor for a save under ``s3://bucket/prefix``: the two listings the
    coordinator makes (the work folder, and ``_ranks/``), each paged through by plain boto3, the
    two at once."""
    from botocore.config import Config

    client = s3.client(Config(max_pool_connections=threads))

    def listed(folder: str) -> int:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{folder}/", Delimiter="/"
        )
        return sum(len(page.get("Contents", ())) for page in pages)

    def measure(save: SimulatedSave) -> float:
        folders = [f"{prefix}/{save.work_dir}", f"{prefix}/{save.work_dir}/{layout.RANKS_DIR}"]
        with ThreadPoolExecutor(max_workers=2) as pool:
            start = time.perf_counter()
            counts = list(pool.map(listed, folders))
            elapsed = time.perf_counter() - start
        assert counts[1] == save.world_size, counts
        return elapsed

    return measure


def _linearity(points: dict[str, Any]) -> dict[str, float]:
    """Each N's time per rank over the smallest N's: 1.0 is linear, below is better."""
    ordered = sorted(points.values(), key=lambda p: p["world_size"])
    base = ordered[0]["per_rank_ms"]
    return {str(p["world_size"]): p["per_rank_ms"] / base for p in ordered}


_ROOT_NAMES = {"local": "local folder", "s3": "moto S3"}


def report(results: dict[str, Any]) -> str:
    from _common import markdown_table

    workers, serial = str(results["workers"]), results.get("serial_workers")
    rows = []
    for label, by_workers in results["roots"].items():
        points = by_workers[workers]
        linear = _linearity(points)
        for key, p in sorted(points.items(), key=lambda kv: kv[1]["world_size"]):
            row = [
                _ROOT_NAMES[label],
                p["world_size"],
                f"{p['median_s']:.3f}",
                f"{p['min_s']:.3f}",
                f"{p['per_rank_ms']:.2f}",
                f"{linear[key]:.2f}",
            ]
            row += (
                [f"{p['floor_median_s']:.3f}", f"{p['over_floor']:.2f}x"]
                if "floor_median_s" in p
                else ["-", "-"]
            )
            if serial is not None:
                base = by_workers.get(str(serial), {}).get(key)
                row += (
                    ["-", "-"]
                    if base is None
                    else [f"{base['median_s']:.3f}", f"{base['median_s'] / p['median_s']:.2f}x"]
                )
            rows.append(row)
    headers = [
        "root",
        "ranks (N)",
        f"publish s (median, {workers} workers)",
        "min s",
        "ms per rank",
        "per rank / smallest N's",
        "floor s (the two listings, plain boto3)",
        "publish / floor",
    ]
    if serial is not None:
        headers += [f"{serial} worker s (serial)", "parallel speedup"]
    lines = [markdown_table(headers, rows), ""]
    lines += [f"- {label}: {verdict}" for label, verdict in results["targets"].items()]
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> dict[str, str]:
    verdicts: dict[str, str] = {}
    for label, by_workers in results["roots"].items():
        points = by_workers[str(results["workers"])]
        largest = max(points.values(), key=lambda p: p["world_size"])
        if largest["world_size"] == 4096:
            limit = TARGET_S[label]
            ok = largest["median_s"] <= limit
            verdicts[f"{label}: 4,096 ranks in <= {limit:g} s"] = (
                f"{largest['median_s']:.2f} s - {'met' if ok else 'MISSED'}"
            )
        ratio = max(_linearity(points).values())
        verdicts[f"{label}: linear (worst per-rank time <= {LINEAR_SLACK:g}x the smallest N's)"] = (
            f"{ratio:.2f}x - {'met' if ratio <= LINEAR_SLACK else 'MISSED'}"
        )
    return verdicts


def plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    workers, serial = str(results["workers"]), results.get("serial_workers")
    for label, color in (("local", "tab:blue"), ("s3", "tab:orange")):
        by_workers = results["roots"].get(label)
        if not by_workers:
            continue
        name = _ROOT_NAMES[label]
        ordered = sorted(by_workers[workers].values(), key=lambda p: p["world_size"])
        xs = [p["world_size"] for p in ordered]
        ys = [p["median_s"] for p in ordered]
        ax.plot(xs, ys, marker="o", color=color, label=f"{name}, {workers} workers")
        if serial is not None and str(serial) in by_workers:
            base = sorted(by_workers[str(serial)].values(), key=lambda p: p["world_size"])
            ax.plot(
                [p["world_size"] for p in base],
                [p["median_s"] for p in base],
                marker="x",
                linestyle="-.",
                color=color,
                alpha=0.6,
                label=f"{name}, serial",
            )
        # Linear from the smallest N: what "time growing linearly in N" means on this plot.
        ax.plot(
            xs,
            [ys[0] * x / xs[0] for x in xs],
            linestyle=":",
            color=color,
            label=f"{name}, linear from N={xs[0]}",
        )
        ax.scatter([4096], [TARGET_S[label]], marker="*", s=120, color=color, zorder=3)
        ax.annotate(
            f" target: {TARGET_S[label]:g} s at 4,096",
            (4096, TARGET_S[label]),
            fontsize=7,
            ha="right",
            va="bottom",
            color=color,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("Coordinator verify-and-publish vs world size")
    ax.set_xlabel("simulated ranks (N)")
    ax.set_ylabel("publish time, s (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _merged(path: Path, results: dict[str, Any]) -> dict[str, Any]:
    """``results`` plus the roots an earlier run with the same settings saved in ``path`` and
    this one did not measure (so ``--roots local`` and ``--roots s3`` can run separately)."""
    if not path.exists():
        return results
    import json

    earlier = json.loads(path.read_text())
    same = all(
        earlier.get(k) == results[k] for k in ("workers", "serial_workers", "items_per_rank")
    )
    if not same:
        return results
    for label, points in earlier.get("roots", {}).items():
        if label not in results["roots"]:
            results["roots"][label] = points
            results.setdefault("merged_from", []).append(
                {"root": label, "command": earlier["command"], "machine": earlier["machine"]}
            )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument(
        "--s3-world-sizes", type=int, nargs="+", default=None, help="default: --world-sizes"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=DEFAULT_COMMIT_WORKERS)
    parser.add_argument(
        "--serial", action="store_true", help="also time workers=1 (the serial coordinator)"
    )
    parser.add_argument("--roots", nargs="+", choices=("local", "s3"), default=["local", "s3"])
    parser.add_argument("--dir", default=None, help="parent of the local root (default: tmp)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results file")
    parser.add_argument("--plot", default=str(DEFAULT_PLOT), help="PNG figure ('' for none)")
    args = parser.parse_args(argv)

    from _common import describe_machine, describe_machine_line, write_results

    scratch = Path(tempfile.mkdtemp(prefix="bench-coordinator-", dir=args.dir))
    machine = describe_machine(str(scratch))
    print(describe_machine_line(machine), flush=True)
    shown = sys.argv[1:] if argv is None else list(argv)
    workers = [args.workers, 1] if args.serial and args.workers != 1 else [args.workers]
    results: dict[str, Any] = {
        "command": " ".join([".venv/bin/python benchmarks/bench_coordinator.py", *shown]),
        "machine": machine,
        "workers": args.workers,
        "serial_workers": 1 if len(workers) > 1 else None,
        "items_per_rank": ITEMS_PER_RANK,
        "roots": {},
    }
    try:
        if "local" in args.roots:
            local = open_backend(str(scratch / "root"))
            sizes = sorted(args.world_sizes)
            results["roots"]["local"] = measure_root(
                "local", local, sizes, args.rounds, workers, local.remove_tree
            )
        if "s3" in args.roots:
            from bench_s3 import moto_server

            with moto_server() as (s3, _server):
                s3.create_bucket(BUCKET)
                remote = open_backend(f"s3://{BUCKET}/coord", s3.storage_options())
                sizes = sorted(args.s3_world_sizes or args.world_sizes)
                floor = get_floor(s3, BUCKET, "coord", args.workers)
                results["roots"]["s3"] = measure_root(
                    "s3", remote, sizes, args.rounds, workers, remote.remove_tree, floor
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = _merged(Path(args.out), results)
    results["targets"] = targets(results)
    print()
    print(report(results))
    print(f"\nresults: {write_results(args.out, results)}")
    if args.plot:
        print(f"plot: {plot(results, Path(args.plot))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
