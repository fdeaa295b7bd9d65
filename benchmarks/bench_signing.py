"""What signing costs: a signed save and load against an unsigned one, in the same run.

Usage::

    .venv/bin/python benchmarks/bench_signing.py [--rounds 5] [--dir D] [--no-fsync]

Two shapes of float32 state: 16 tensors of 16 MiB (256 MiB; hashing dominates) and 2,000
tensors of 32 KiB (62.5 MiB; per-item work dominates). For each, one process measures,
alternating the order from round to round, ``dcp_safe.save`` (durable, fsync on) and then
``dcp_safe.load`` (every item verified, the default) of:

* *unsigned*: the default, xxh3-128 item checksums;
* *signed sha256*: ``WriterOptions(signing_key=..., checksum="sha256")`` (the signed default
  before BLAKE3, still selectable);
* *signed*: ``WriterOptions(signing_key=...)``, the default: BLAKE3 item checksums, an HMAC
  over the manifest digest in ``_SIGNATURE``; the reader given the key checks it against the
  manifest it opened;
* *signed, blake3 on one thread*: the same with ``BLAKE3_MAX_THREADS`` set to 1 instead of the
  default ``AUTO`` (one large update spread over every core).

(Earlier runs also measured unsigned sha256 against signed sha256 and found them equal within
the noise: the signature is free, the item hash is the whole cost. docs/integrity.md.)

First, the item hashes alone: CPU seconds on one thread (``time.thread_time``, so other jobs
on a shared machine barely move it) to hash 256 MiB in 16 MiB updates, per algorithm.

The target (issue 17) is signed / unsigned <= 1.05 for a save plus its load. Each save is
loaded twice: first from storage (its files are evicted from the page cache after the durable
save, with ``posix_fadvise(DONTNEED)``, as after a restart), then again from the page cache, the
worst case for a slower hash: nothing else to wait for. Both are reported. Results go to
``benchmarks/results/bench_signing-<time>.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

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
from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.manifest import checksum

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"16 x 16 MiB": (16, 4 << 20), "2,000 x 32 KiB": (2_000, 8 << 10)}
KEY = "hex:" + "42" * 32
PARTS = ("save", "cold load", "warm load", "save + cold load", "save + warm load")
CONTENDERS: dict[str, dict[str, Any]] = {
    "unsigned": {},
    "signed sha256": {"signing_key": KEY, "checksum": "sha256"},
    "signed": {"signing_key": KEY},
    "signed, blake3 on one thread": {"signing_key": KEY, "blake3_max_threads": 1},
}


def make_state(count: int, numel: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.randn(numel) for i in range(count)}


def load_into(
    root: Path, name: str, state: dict[str, torch.Tensor], signing_key: str | None
) -> float:
    """One verified load of ``name`` into fresh tensors; its wall seconds."""
    target = {key: torch.empty_like(value) for key, value in state.items()}
    start = time.perf_counter()
    reader = SafeStorageReader(root, signing_key=signing_key)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    seconds = time.perf_counter() - start
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError("the load differs from the save")
    return seconds


def save_and_load(
    root: Path, name: str, state: dict[str, torch.Tensor], options: dict[str, Any], fsync: bool
) -> tuple[float, float, float]:
    """One durable save, then a verified load from storage and one from the page cache;
    returns their wall seconds."""
    options = dict(options)
    threads = options.pop("blake3_max_threads", None)
    default_threads = checksum.BLAKE3_MAX_THREADS
    if threads is not None:
        checksum.BLAKE3_MAX_THREADS = threads
    try:
        writer = SafeStorageWriter(root, options=WriterOptions(fsync=fsync, **options))
        start = time.perf_counter()
        dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)
        saved = time.perf_counter() - start
        evict(root / name)
        cold = load_into(root, name, state, options.get("signing_key"))
        warm = load_into(root, name, state, options.get("signing_key"))
    finally:
        checksum.BLAKE3_MAX_THREADS = default_threads
    return saved, cold, warm


def measure(
    work: Path, shape: str, count: int, numel: int, args: argparse.Namespace
) -> dict[str, Any]:
    state = make_state(count, numel)
    times: dict[str, dict[str, list[float]]] = {
        key: {part: [] for part in PARTS} for key in CONTENDERS
    }
    for options in CONTENDERS.values():  # warm up: allocator, page cache, imports
        save_and_load(work, "warm", state, options, args.fsync)
        shutil.rmtree(work / "warm")
    for round_ in range(args.rounds):
        for key in rotate(list(CONTENDERS), round_):
            name = f"r{round_}"
            save_s, cold_s, warm_s = save_and_load(work, name, state, CONTENDERS[key], args.fsync)
            shutil.rmtree(work / name)
            for part, seconds in zip(
                PARTS, (save_s, cold_s, warm_s, save_s + cold_s, save_s + warm_s), strict=True
            ):
                times[key][part].append(seconds)
    med = {key: {part: median(v) for part, v in parts.items()} for key, parts in times.items()}
    ratios = {
        key: {part: med[key][part] / med["unsigned"][part] for part in PARTS} for key in CONTENDERS
    }
    per_round = {
        part: median(
            [s / u for s, u in zip(times["signed"][part], times["unsigned"][part], strict=True)]
        )
        for part in ("save + cold load", "save + warm load")
    }
    return {
        "shape": shape,
        "tensors": count,
        "bytes": count * numel * 4,
        "median_s": med,
        "over_unsigned": ratios,
        "signed_over_unsigned_per_round_median": per_round,
        "rounds": args.rounds,
        "fsync": args.fsync,
    }


def measure_hashes(rounds: int, size_bytes: int = 256 << 20) -> dict[str, float]:
    """Median CPU seconds per GB of each item checksum on one thread, order rotated (BLAKE3
    held to the calling thread, whose CPU time is all ``thread_time`` sees)."""
    data = memoryview(bytes(torch.randint(0, 256, (size_bytes,), dtype=torch.uint8).numpy()))
    seconds: dict[str, list[float]] = {a.value: [] for a in checksum.ChecksumAlgorithm}
    default_threads, checksum.BLAKE3_MAX_THREADS = checksum.BLAKE3_MAX_THREADS, 1
    try:
        for round_ in range(rounds):
            for algorithm in rotate(list(seconds), round_):
                hasher = checksum.new_hasher(algorithm)
                start = time.thread_time()
                for at in range(0, size_bytes, 16 << 20):
                    hasher.update(data[at : at + (16 << 20)])
                hasher.hexdigest()
                seconds[algorithm].append(time.thread_time() - start)
    finally:
        checksum.BLAKE3_MAX_THREADS = default_threads
    return {a: median(v) / (size_bytes / 1e9) for a, v in seconds.items()}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    hashes = measure_hashes(args.rounds)
    rows = [measure(work, name, c, n, args) for name, (c, n) in SHAPES.items()]
    return {
        "machine": describe_machine(str(work)),
        "torch": torch.__version__,
        "hash_cpu_s_per_gb": hashes,
        "shapes": rows,
    }


def report(results: dict[str, Any]) -> str:
    rows = []
    for r in results["shapes"]:
        for key in CONTENDERS:
            m, x = r["median_s"][key], r["over_unsigned"][key]
            rows.append(
                [
                    r["shape"],
                    key,
                    *(f"{m[part]:.3f} s ({x[part]:.3f}x)" for part in PARTS),
                ]
            )
    headers = ["state", "checkpoint", *PARTS]
    hashes = [
        [name, f"{cpu:.3f}", f"{1 / cpu:.2f}"] for name, cpu in results["hash_cpu_s_per_gb"].items()
    ]
    return (
        markdown_table(["item checksum", "CPU s per GB", "GB/s per core"], hashes)
        + "\n\n"
        + markdown_table(headers, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contender")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false", help="saves skip fsync")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_signing_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_signing-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
