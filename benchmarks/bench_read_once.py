"""Restores that read each byte once: bytes read from storage and restore time, read_once on/off.

Usage::

    .venv/bin/python benchmarks/bench_read_once.py [--world-size 4] [--state 16x16MiB]
        [--rounds 3] [--storage file|s3] [--dir D]

Real gloo ranks on this host (``dcp_safe.testing.multiproc.run_ranks``) save one replicated
state (``COUNTxSIZE`` float32 tensors, equal on every rank, so the checkpoint holds one copy)
with ``dcp_safe.save``, then restore it with ``dcp_safe.load`` two ways, alternating from round
to round, each checked exactly on every rank:

* ``read_once``: ``SafeLoadPlanner()`` (the default): each entry read by one rank, spread across
  ranks, and sent to the others over the load's gloo group;
* ``every_rank``: ``SafeLoadPlanner(read_once=False)``: every rank reads all it needs (today's).

Each with the files in the page cache (``warm``) and after ``posix_fadvise(DONTNEED)`` on every
file (``evicted``; the first rank to read a file brings it back into the cache for the others,
so this is not N disk reads even for ``every_rank``). A restore's time is rank 0's, from a
barrier before to a barrier after. ``--storage s3``: the root is a bucket of a local moto S3
server (``dcp_safe.testing.s3``, in this process's threads) instead, read over HTTP (no page
cache: one row per contender, ``remote``). Bytes read: the sum over ranks of each reader's
``bytes_read``. Medians over rounds. Results: ``benchmarks/results/bench_read_once-<time>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    evict,
    markdown_table,
    median,
    parse_state,
    rotate,
    run_and_report,
    write_results,
)

import dcp_safe
from dcp_safe import SafeLoadPlanner, SafeStorageReader, SafeStorageWriter
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.units import format_size

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDERS = ("read_once", "every_rank")
CACHES = ("warm", "evicted")


def make_state(count: int, size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i:05d}": torch.randn(size // 4, generator=gen) for i in range(count)}


def _restore(
    root: str, options: dict[str, Any] | None, state: dict[str, torch.Tensor], contender: str
) -> tuple[float, int, int]:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = SafeStorageReader(root, storage_options=options)
    planner = SafeLoadPlanner(read_once=contender == "read_once")
    dist.barrier()
    start = time.perf_counter()
    dcp_safe.load(target, checkpoint_id="replicated", storage_reader=reader, planner=planner)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError(f"{contender} did not restore the state exactly")
    return elapsed, reader.bytes_read, planner.bytes_received


def _rank(
    rank: int,
    world_size: int,
    root: str,
    options: dict[str, Any] | None,
    count: int,
    size: int,
    rounds: int,
) -> Any:
    state = make_state(count, size)
    writer = SafeStorageWriter(root, storage_options=options)
    dcp_safe.save(state, checkpoint_id="replicated", storage_writer=writer)
    caches = CACHES if options is None else ("remote",)
    runs: list[dict[str, Any]] = []
    for round_ in range(rounds):
        for contender in rotate(list(CONTENDERS), round_):
            for cache in caches:
                if cache == "evicted" and rank == 0:
                    evict(Path(root))
                elapsed, read, received = _restore(root, options, state, contender)
                runs.append(
                    {
                        "contender": contender,
                        "cache": cache,
                        "s": elapsed,
                        "read": read,
                        "received": received,
                    }
                )
    return runs


def _item_bytes(root: str, options: dict[str, Any] | None) -> int:
    from dcp_safe.backends.roots import open_backend
    from dcp_safe.checkpoints.committed import open_committed

    manifest = open_committed(open_backend(root, options), "replicated").manifest
    return sum(i.length for i in manifest.items)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if args.storage == "s3":
        from dcp_safe.testing.s3 import local_s3

        with local_s3() as s3:
            root = f"s3://{s3.create_bucket()}/run"
            return _run(args, work, root, s3.storage_options())
    return _run(args, work, str(work / "root"), None)


def _run(
    args: argparse.Namespace, work: Path, root: str, options: dict[str, Any] | None
) -> dict[str, Any]:
    count, size = parse_state(args.state)
    load_before = os.getloadavg()
    per_rank = run_ranks(
        _rank,
        args.world_size,
        args=(root, options, count, size, args.rounds),
        timeout_s=3600,
    )
    load_after = os.getloadavg()
    checkpoint = _item_bytes(root, options)
    rows = []
    for contender in CONTENDERS:
        for cache in CACHES if options is None else ("remote",):
            picked = [
                [r for r in runs if r["contender"] == contender and r["cache"] == cache]
                for runs in per_rank
            ]
            times = [r["s"] for r in picked[0]]  # rank 0's, barrier to barrier
            read = [sum(runs[i]["read"] for runs in picked) for i in range(len(picked[0]))]
            received = [sum(runs[i]["received"] for runs in picked) for i in range(len(picked[0]))]
            rows.append(
                {
                    "contender": contender,
                    "cache": cache,
                    "median_s": median(times),
                    "bytes_read": median(read),
                    "bytes_received": median(received),
                    "read_over_checkpoint": median(read) / checkpoint,
                }
            )
    return {
        "machine": describe_machine(str(work)),
        "torch": torch.__version__,
        "world_size": args.world_size,
        "storage": args.storage,
        "state": args.state,
        "checkpoint_item_bytes": checkpoint,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "rows": rows,
    }


def report(results: dict[str, Any]) -> str:
    base = {r["cache"]: r["median_s"] for r in results["rows"] if r["contender"] == "every_rank"}
    lines = [
        [
            r["contender"],
            r["cache"],
            f"{r['median_s']:.3f}",
            f"{r['median_s'] / base[r['cache']]:.2f}",
            f"{format_size(int(r['bytes_read']))} ({r['read_over_checkpoint']:.2f}x)",
            format_size(int(r["bytes_received"])),
        ]
        for r in results["rows"]
    ]
    headers = [
        "restore",
        "page cache",
        "median s",
        "x every_rank",
        "read from storage (x checkpoint)",
        "sent between ranks",
    ]
    load = ", ".join(f"{x:.1f}" for x in results["load_average_before"])
    return (
        f"{results['world_size']} ranks, {results['state']} replicated on {results['storage']} "
        f"({format_size(results['checkpoint_item_bytes'])} of items), load average {load}\n"
        + markdown_table(headers, lines)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--state", default="16x16MiB", type=lambda s: parse_state(s) and s)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--storage", choices=("file", "s3"), default="file")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_read_once_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_read_once-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
