"""Resharded loads that read only what they need: bytes read and restore time, blocks on/off.

Usage::

    .venv/bin/python benchmarks/bench_resharded_load.py [--size-mib 256] [--save-ranks 2]
        [--load-ranks 4] [--rounds 3] [--dir D]

Real gloo ranks on this host (``dcp_safe.testing.multiproc.run_ranks``): ``--save-ranks`` ranks
save one float32 tensor of ``--size-mib`` as a DTensor ``Shard(0)`` twice, with block digests
(``blocks``, the default) and without (``whole``: ``WriterOptions(block_digests=False)``, what
every load read before them), timing each save (rank 0, barrier to barrier). Then
``--load-ranks`` ranks load each into a ``Shard(0)`` DTensor of their own mesh, alternating
from round to round, checked exactly on every rank, with the files in the page cache
(``warm``) and after ``posix_fadvise(DONTNEED)`` on every file (``evicted``). A restore's time
is rank 0's, barrier to barrier; bytes read: the sum over ranks of each reader's
``bytes_read``. Medians over rounds. Results:
``benchmarks/results/bench_resharded_load-<time>.json``.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    describe_machine,
    evict,
    markdown_table,
    median,
    rotate,
    run_and_report,
    write_results,
)

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter
from dcp_safe.adapters.options import WriterOptions
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.units import format_size

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDERS = ("blocks", "whole")
CACHES = ("warm", "evicted")
COLS = 1024  # float32 columns: a row is 4 KiB


def _full(size_mib: int) -> torch.Tensor:
    rows = size_mib * (1 << 20) // (4 * COLS)
    return torch.randn(rows, COLS, generator=torch.Generator().manual_seed(0))


def _sharded(world_size: int, tensor: torch.Tensor) -> dict[str, Any]:
    return {"w": distribute_tensor(tensor, init_device_mesh("cpu", (world_size,)), [Shard(0)])}


def _save_rank(rank: int, world_size: int, root: str, size_mib: int, rounds: int) -> Any:
    state = _sharded(world_size, _full(size_mib))
    runs = []
    for round_ in range(rounds):
        for contender in rotate(list(CONTENDERS), round_):
            options = WriterOptions(block_digests=contender == "blocks", overwrite=True)
            writer = SafeStorageWriter(root, options=options)
            dist.barrier()
            start = time.perf_counter()
            dcp_safe.save(state, checkpoint_id=contender, storage_writer=writer)
            dist.barrier()
            runs.append({"contender": contender, "s": time.perf_counter() - start})
    return runs


def _load_rank(rank: int, world_size: int, root: str, size_mib: int, rounds: int) -> Any:
    expected = _full(size_mib).chunk(world_size)[rank]
    runs = []
    for round_ in range(rounds):
        for contender in rotate(list(CONTENDERS), round_):
            for cache in CACHES:
                if cache == "evicted" and rank == 0:
                    evict(Path(root))
                target = _sharded(world_size, torch.zeros(expected.shape[0] * world_size, COLS))
                reader = SafeStorageReader(root)
                dist.barrier()
                start = time.perf_counter()
                dcp_safe.load(target, checkpoint_id=contender, storage_reader=reader)
                dist.barrier()
                elapsed = time.perf_counter() - start
                if not torch.equal(target["w"].to_local(), expected):
                    raise AssertionError(f"{contender} did not restore the shard exactly")
                runs.append(
                    {
                        "contender": contender,
                        "cache": cache,
                        "s": elapsed,
                        "read": reader.bytes_read,
                    }
                )
    return runs


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    root = str(work / "root")
    load_before = os.getloadavg()
    saves = run_ranks(
        _save_rank, args.save_ranks, args=(root, args.size_mib, args.rounds), timeout_s=3600
    )
    loads = run_ranks(
        _load_rank, args.load_ranks, args=(root, args.size_mib, args.rounds), timeout_s=3600
    )
    rows = []
    for contender in CONTENDERS:
        save_s = median([r["s"] for r in saves[0] if r["contender"] == contender])
        for cache in CACHES:
            picked = [
                [r for r in runs if r["contender"] == contender and r["cache"] == cache]
                for runs in loads
            ]
            read = [sum(runs[i]["read"] for runs in picked) for i in range(len(picked[0]))]
            rows.append(
                {
                    "contender": contender,
                    "cache": cache,
                    "save_median_s": save_s,
                    "median_s": median([r["s"] for r in picked[0]]),
                    "bytes_read": median(read),
                    "bytes_read_per_rank": median(read) / args.load_ranks,
                }
            )
    return {
        "machine": describe_machine(str(work)),
        "torch": torch.__version__,
        "size_mib": args.size_mib,
        "save_ranks": args.save_ranks,
        "load_ranks": args.load_ranks,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }


def report(results: dict[str, Any]) -> str:
    base = {r["cache"]: r["median_s"] for r in results["rows"] if r["contender"] == "whole"}
    lines = [
        [
            r["contender"],
            r["cache"],
            f"{r['median_s']:.3f}",
            f"{r['median_s'] / base[r['cache']]:.2f}",
            format_size(int(r["bytes_read"])),
            format_size(int(r["bytes_read_per_rank"])),
            f"{r['save_median_s']:.3f}",
        ]
        for r in results["rows"]
    ]
    headers = [
        "checkpoint",
        "page cache",
        "load median s",
        "x whole",
        "read (all ranks)",
        "read per rank",
        "save median s",
    ]
    load = ", ".join(f"{x:.1f}" for x in results["load_average_before"])
    return (
        f"{results['size_mib']} MiB saved on {results['save_ranks']} ranks, loaded on "
        f"{results['load_ranks']}, load average {load}\n" + markdown_table(headers, lines)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--save-ranks", type=int, default=2)
    parser.add_argument("--load-ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_resharded_load_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_resharded_load-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
