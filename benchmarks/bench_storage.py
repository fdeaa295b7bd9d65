"""Storage benchmark: SafeStorageWriter/Reader against torch's FileSystemWriter/Reader.

Usage::

    .venv/bin/python benchmarks/bench_storage.py --size-gib 1 --rounds 3 [--threads 1] [--dir D]

Everything runs in one process, on one state dict (16 float32 tensors of 64 MiB per GiB, plus
small tensors and a non-tensor entry), so the contenders see the same machine at the same time:

* save: SafeStorageWriter (xxh3_128, the default) vs ``FileSystemWriter(sync_files=True)`` with
  the same ``thread_count``; each round writes a fresh directory, deleted afterwards, and the
  order of contenders rotates from round to round, after one untimed full-size round. Nothing
  is dropped from the page cache (an unprivileged process cannot), so every contender writes
  into a warm cache and pays its fsync.
* durable commit: the same rounds also time the floor, the same tensor bytes written to one
  file with ``os.write`` from memoryviews, then fsync of the file and of its folder.
  dcp_safe's time to a durable commit is its whole ``dcp.save`` (shards, manifests, publish).
* load: SafeStorageReader (verify=True, and verify=False to show what checking costs) vs
  ``FileSystemReader`` on the same committed checkpoint, into the same preallocated tensors.
* one round each of the sha256 and crc32 writers, and of zstd on a compressible state.
* checksum throughput over a 256 MiB buffer in memory.

Results print as markdown tables and go to ``benchmarks/results/storage.json`` (merged per
thread count, so runs with ``--threads 1`` and ``--threads 2`` sit side by side).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (
    MIB,
    RssSampler,
    describe_machine,
    describe_machine_line,
    fmt_rate,
    format_size,
    markdown_table,
    median,
    process_cpu_seconds,
    rotate,
    run_and_report,
    timed,
    write_results,
)

from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions

NAME = "step_000100"
BIG_TENSOR_BYTES = 64 * MIB
HASH_BUFFER_BYTES = 256 * MIB
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "storage.json"

SAVE_TARGET = 1.15  # dcp_safe save time / torch save time, at most
LOAD_TARGET = 1.15  # dcp_safe load time / torch load time, at most
DURABLE_TARGET = 0.85  # (issue 18) dcp_safe durable throughput / raw floor throughput, at least

State = dict[str, Any]


# ----------------------------------------------------------------------------- state dicts


def make_state(size_bytes: int, *, compressible: bool = False, seed: int = 0) -> State:
    """``size_bytes`` (rounded to 64 MiB tensors) of float32 plus small tensors and a dict.

    The compressible variant holds small integers, about three quarters of them zero (think
    quantized or sparse weights), which zstd shrinks several times over.
    """
    gen = torch.Generator().manual_seed(seed)
    numel = BIG_TENSOR_BYTES // 4
    state: State = {}
    for i in range(max(1, round(size_bytes / BIG_TENSOR_BYTES))):
        if compressible:
            t = torch.randint(0, 16, (numel,), generator=gen, dtype=torch.int32).float()
            t[t > 3] = 0
        else:
            t = torch.randn(numel, generator=gen)
        state[f"layers.{i:02d}.weight"] = t.view(4096, numel // 4096)
    for i in range(32):
        state[f"layers.{i:02d}.bias"] = torch.randn(1024, generator=gen)
    state["step"] = torch.tensor(100, dtype=torch.int64)
    state["extra"] = {"epoch": 3, "note": "bench_storage"}
    return state


def tensor_bytes(state: State) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def empty_like_state(state: State) -> State:
    """Preallocated, touched targets (zeroed so every page is resident before a timed load)."""
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else _blank(v)
        for k, v in state.items()
    }


def _blank(value: Any) -> Any:
    """A placeholder of the same shape (DCP flattens nested dicts into one key per leaf)."""
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    return type(value)()


def check_equal(expected: State, actual: State, what: str) -> None:
    for key, value in expected.items():
        got = actual[key]
        same = torch.equal(value, got) if isinstance(value, torch.Tensor) else value == got
        if not same:
            raise SystemExit(f"{what}: {key} does not round-trip")


def zero_(state: State) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            value.zero_()
        else:
            state[key] = _blank(value)


def dir_bytes(path: Path, suffix: str = "") -> int:
    return sum(p.stat().st_size for p in path.rglob(f"*{suffix}") if p.is_file())


# ----------------------------------------------------------------------------- contenders


def save_safe(
    state: State, root: Path, threads: int, *, checksum: str = "xxh3_128", compression: str = "none"
) -> Path:
    writer = SafeStorageWriter(
        root,
        options=WriterOptions(thread_count=threads, checksum=checksum, compression=compression),
    )
    dcp.save(state, checkpoint_id=NAME, storage_writer=writer, no_dist=True)
    return root / NAME


def save_torch(state: State, path: Path, threads: int, *, zstd: bool = False) -> Path:
    writer = FileSystemWriter(
        path,
        sync_files=True,
        thread_count=threads,
        _extensions=[ZStandard()] if zstd else None,
    )
    dcp.save(state, storage_writer=writer, no_dist=True)
    return path


def write_raw_floor(state: State, path: Path) -> Path:
    """The floor: every tensor's bytes, in order, into one file; fsync the file and its folder."""
    path.mkdir(parents=True)
    target = path / "raw.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                view = memoryview(value.contiguous().view(-1).view(torch.uint8).numpy())
                while view:
                    view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_safe(target: State, root: Path, *, verify: bool = True) -> None:
    reader = SafeStorageReader(root, verify=verify)
    dcp.load(target, checkpoint_id=NAME, storage_reader=reader, no_dist=True)


def load_torch(target: State, path: Path) -> None:
    dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)


# ----------------------------------------------------------------------------- measuring


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    """One timed call with the RSS peak sampler running; a GC first so rounds start alike.

    CPU seconds (user + system, all threads of this process) are recorded too: on a shared
    machine wall time also measures the neighbours, CPU time mostly measures the code.
    """
    gc.collect()
    with RssSampler() as rss:
        cpu_before = process_cpu_seconds()
        seconds, _ = timed(fn)
        cpu_s = process_cpu_seconds() - cpu_before
    return {"seconds": seconds, "cpu_s": cpu_s, "rss_peak_delta_bytes": rss.peak_delta_bytes}


def summarize(runs: list[dict[str, float]], payload_bytes: int) -> dict[str, Any]:
    times = [r["seconds"] for r in runs]
    med = median(times)
    return {
        "seconds": times,
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "median_gbps": payload_bytes / med / 1e9,
        "cpu_s": [r["cpu_s"] for r in runs],
        "median_cpu_s": median(r["cpu_s"] for r in runs),
        "rss_peak_delta_bytes_max": max(r["rss_peak_delta_bytes"] for r in runs),
    }


def warm_up(work: Path, threads: int) -> None:
    """A tiny save and load with each contender, so imports and first-call costs are paid."""
    small = make_state(0)
    small = {k: v for k, v in small.items() if not k.startswith("layers.00.weight")}
    save_safe(small, work / "warm_safe", threads)
    save_torch(small, work / "warm_torch", threads)
    target = empty_like_state(small)
    load_safe(target, work / "warm_safe")
    load_torch(target, work / "warm_torch")
    shutil.rmtree(work / "warm_safe")
    shutil.rmtree(work / "warm_torch")


def bench_saves(state: State, work: Path, threads: int, rounds: int) -> dict[str, Any]:
    payload = tensor_bytes(state)
    contenders: dict[str, Callable[[Path], Path]] = {
        "dcp_safe": lambda p: save_safe(state, p, threads),
        "torch": lambda p: save_torch(state, p, threads),
        "raw_floor": lambda p: write_raw_floor(state, p),
    }
    # An untimed full-size round first: the first gigabyte a process writes after allocating
    # its state costs up to 3x more system time here (fresh guest pages), and it would always
    # land on whichever contender goes first in round 0.
    for name, fn in contenders.items():
        shutil.rmtree(fn(work / f"save_warm_{name}"))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    orders = []
    for r in range(rounds):
        order = rotate(list(contenders), r)
        orders.append(order)
        for name in order:
            path = work / f"save_r{r}_{name}"
            run = measure(lambda name=name, path=path: contenders[name](path))
            run["disk_bytes"] = dir_bytes(path)
            runs[name].append(run)
            shutil.rmtree(path)
            print(f"  save round {r} {name:10s} {run['seconds']:.3f} s", flush=True)
    result = {name: summarize(rs, payload) for name, rs in runs.items()}
    for name, rs in runs.items():
        result[name]["disk_bytes"] = rs[0]["disk_bytes"]
    result["orders"] = orders
    return result


def bench_loads(
    state: State, work: Path, threads: int, rounds: int
) -> tuple[dict[str, Any], State]:
    root = work / "load_src"
    save_safe(state, root, threads)
    target = empty_like_state(state)
    payload = tensor_bytes(state)
    contenders: dict[str, Callable[[], None]] = {
        "dcp_safe": lambda: load_safe(target, root),
        "torch": lambda: load_torch(target, root / NAME),
        "dcp_safe_noverify": lambda: load_safe(target, root, verify=False),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in rotate(list(contenders), r):
            zero_(target)
            run = measure(contenders[name])
            check_equal(state, target, f"load with {name}")
            runs[name].append(run)
            print(f"  load round {r} {name:18s} {run['seconds']:.3f} s", flush=True)
    shutil.rmtree(root)
    return {name: summarize(rs, payload) for name, rs in runs.items()}, target


def bench_checksum_variants(state: State, work: Path, threads: int) -> dict[str, Any]:
    payload = tensor_bytes(state)
    out: dict[str, Any] = {}
    for algo in ("sha256", "crc32"):
        path = work / f"save_{algo}"
        run = measure(lambda algo=algo, path=path: save_safe(state, path, threads, checksum=algo))
        shutil.rmtree(path)
        out[algo] = summarize([run], payload)
        print(f"  save {algo:8s} {run['seconds']:.3f} s", flush=True)
    return out


def bench_zstd(size_bytes: int, work: Path, threads: int) -> dict[str, Any]:
    """One round each: none vs zstd with dcp_safe, zstd with torch; then a verified zstd load."""
    state = make_state(size_bytes, compressible=True, seed=1)
    payload = tensor_bytes(state)
    saves: dict[str, Callable[[Path], Path]] = {
        "dcp_safe_none": lambda p: save_safe(state, p, threads),
        "dcp_safe_zstd": lambda p: save_safe(state, p, threads, compression="zstd"),
        "torch_zstd": lambda p: save_torch(state, p, threads, zstd=True),
    }
    out: dict[str, Any] = {"payload_bytes": payload}
    for name, fn in saves.items():
        path = work / f"zstd_{name}"
        run = measure(lambda fn=fn, path=path: fn(path))
        shards = dir_bytes(path, ".distcp")
        out[name] = summarize([run], payload) | {
            "shard_bytes": shards,
            "compression_ratio": payload / shards,
        }
        print(f"  zstd {name:14s} {run['seconds']:.3f} s, shards {format_size(shards)}", flush=True)
        if name == "dcp_safe_zstd":
            target = empty_like_state(state)
            load = measure(lambda path=path, target=target: load_safe(target, path))
            check_equal(state, target, "zstd load")
            out["dcp_safe_zstd_load"] = summarize([load], payload)
            del target
        shutil.rmtree(path)
    return out


def _hashers() -> dict[str, Callable[[Any], object]]:
    def xxh(factory: Callable[[], Any]) -> Callable[[Any], object]:
        def run(buf: Any) -> object:
            h = factory()
            h.update(buf)
            return h.digest()

        return run

    hashers: dict[str, Callable[[Any], object]] = {
        "xxh3_128": xxh(xxhash.xxh3_128),
        "xxh3_64": xxh(xxhash.xxh3_64),
        "zlib.crc32": zlib.crc32,
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "blake2b": lambda b: hashlib.blake2b(b).digest(),
    }
    try:
        import google_crc32c

        hashers[f"crc32c (google_crc32c, {google_crc32c.implementation})"] = google_crc32c.value
    except ImportError:
        pass
    hashers["copy into a new bytearray (reference)"] = lambda b: bytearray(b)
    return hashers


def bench_checksums(rounds: int) -> dict[str, Any]:
    array = np.random.default_rng(0).integers(0, 256, HASH_BUFFER_BYTES, dtype=np.uint8)
    array.flags.writeable = False  # google_crc32c takes only read-only buffers (not memoryviews)
    buf: Any = array
    hashers = _hashers()
    times: dict[str, list[float]] = {name: [] for name in hashers}
    for r in range(rounds):
        for name in rotate(list(hashers), r):
            seconds, _ = timed(lambda name=name: hashers[name](buf))
            times[name].append(seconds)
    return {
        name: {
            "seconds": ts,
            "median_s": median(ts),
            "median_gbps": HASH_BUFFER_BYTES / median(ts) / 1e9,
        }
        for name, ts in times.items()
    }


# ----------------------------------------------------------------------------- reporting


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report(results: dict[str, Any]) -> str:
    payload = results["payload_bytes"]
    saves, loads = results["save"], results["load"]
    threads = results["args"]["threads"]
    lines = [
        f"## Storage benchmark: {format_size(payload)} of tensors, thread_count={threads}, "
        f"{results['args']['rounds']} rounds (medians)",
        "",
        describe_machine_line(results["machine"]),
        f"Load average at start {_load(results['machine'])}, at end {_load(results)}; "
        "ratios are of wall-clock medians; the ratio of minima is the steadier estimate where "
        "the machine only ever adds time; CPU time is user + system, all threads.",
        "",
    ]
    save_ratio = saves["dcp_safe"]["median_s"] / saves["torch"]["median_s"]
    load_ratio = loads["dcp_safe"]["median_s"] / loads["torch"]["median_s"]
    durable = saves["raw_floor"]["median_s"] / saves["dcp_safe"]["median_s"]
    lines += [
        markdown_table(
            [
                "measure",
                "dcp_safe",
                "reference",
                "ratio",
                "target",
                "verdict",
                "ratio of minima",
                "CPU-time ratio",
            ],
            [
                _ratio_row("save", saves, "dcp_safe", "torch", save_ratio, f"<= {SAVE_TARGET}"),
                _ratio_row(
                    "load (verify=True)",
                    loads,
                    "dcp_safe",
                    "torch",
                    load_ratio,
                    f"<= {LOAD_TARGET}",
                ),
                [
                    "durable commit throughput (vs raw floor)",
                    fmt_rate(payload, saves["dcp_safe"]["median_s"]),
                    fmt_rate(payload, saves["raw_floor"]["median_s"]),
                    f"{durable:.2f}",
                    f">= {DURABLE_TARGET}",
                    _verdict(durable >= DURABLE_TARGET),
                    f"{saves['raw_floor']['min_s'] / saves['dcp_safe']['min_s']:.2f}",
                    "",
                ],
            ],
        ),
        "",
        _timing_table("Save", saves, "torch", payload),
        "",
        _timing_table("Load", loads, "torch", payload),
        "",
        _variants_table(results),
        "",
        _zstd_table(results["zstd"]),
        "",
        _checksum_table(results["checksums"], saves["raw_floor"]["median_gbps"]),
    ]
    results["ratios"] = {
        "save_dcp_safe_over_torch": save_ratio,
        "load_dcp_safe_over_torch": load_ratio,
        "durable_dcp_safe_over_raw_floor": durable,
        "targets_met": {
            "save": save_ratio <= SAVE_TARGET,
            "load": load_ratio <= LOAD_TARGET,
            "durable": durable >= DURABLE_TARGET,
        },
    }
    return "\n".join(lines)


def _load(info: dict[str, Any]) -> str:
    return " / ".join(f"{x:.1f}" for x in info.get("load_average") or ())


def _ratio_row(
    what: str, table: dict[str, Any], ours: str, ref: str, ratio: float, target: str
) -> list[str]:
    ok = ratio <= float(target.split()[-1])
    return [
        what,
        f"{table[ours]['median_s']:.3f} s",
        f"{table[ref]['median_s']:.3f} s ({ref})",
        f"{ratio:.2f}",
        target,
        _verdict(ok),
        f"{table[ours]['min_s'] / table[ref]['min_s']:.2f}",
        f"{table[ours]['median_cpu_s'] / table[ref]['median_cpu_s']:.2f}",
    ]


def _timing_table(title: str, table: dict[str, Any], ref: str, payload: int) -> str:
    rows = []
    for name, r in table.items():
        if name == "orders":
            continue
        rows.append(
            [
                name,
                f"{r['median_s']:.3f}",
                f"{r['min_s']:.3f} .. {r['max_s']:.3f}",
                fmt_rate(payload, r["median_s"]),
                f"{r['median_s'] / table[ref]['median_s']:.2f}",
                f"{r['median_cpu_s']:.2f}",
                f"{r['median_cpu_s'] / table[ref]['median_cpu_s']:.2f}",
                format_size(r["rss_peak_delta_bytes_max"]),
            ]
        )
    return f"### {title}\n\n" + markdown_table(
        [
            "contender",
            "median s",
            "min .. max s",
            "throughput",
            f"/ {ref}",
            "CPU s",
            f"CPU / {ref}",
            "peak RSS growth",
        ],
        rows,
    )


def _variants_table(results: dict[str, Any]) -> str:
    saves = results["save"]
    ref, xxh = saves["torch"]["median_s"], saves["dcp_safe"]["median_s"]
    rows = [["xxh3_128 (default, median)", f"{xxh:.3f}", f"{xxh / ref:.2f}", "1.00"]]
    for algo, r in results["checksum_variants"].items():
        s = r["median_s"]
        rows.append([f"{algo} (1 round)", f"{s:.3f}", f"{s / ref:.2f}", f"{s / xxh:.2f}"])
    return "### Save by checksum\n\n" + markdown_table(
        ["dcp_safe checksum", "save s", "/ torch", "/ xxh3_128"], rows
    )


def _zstd_table(z: dict[str, Any]) -> str:
    payload = z["payload_bytes"]
    rows = []
    for name in ("dcp_safe_none", "dcp_safe_zstd", "torch_zstd"):
        r = z[name]
        rows.append(
            [
                name,
                f"{r['median_s']:.3f}",
                fmt_rate(payload, r["median_s"]),
                format_size(r["shard_bytes"]),
                f"{r['compression_ratio']:.2f}x",
            ]
        )
    load = z["dcp_safe_zstd_load"]["median_s"]
    return (
        "### zstd on a compressible state (1 round; small ints, ~75% zeros)\n\n"
        + markdown_table(["save", "s", "throughput", "shard bytes", "ratio"], rows)
        + f"\n\nVerified load of the dcp_safe zstd checkpoint: {load:.3f} s "
        f"({fmt_rate(payload, load)})."
    )


def _checksum_table(table: dict[str, Any], durable_gbps: float) -> str:
    rows = []
    for name, r in sorted(table.items(), key=lambda kv: kv[1]["median_s"]):
        gbps = r["median_gbps"]
        rows.append([name, f"{gbps:.2f}", f"{100 * durable_gbps / gbps:.0f}%"])
    return (
        f"### Checksum throughput ({format_size(HASH_BUFFER_BYTES)} in memory, one thread)\n\n"
        + markdown_table(["algorithm", "GB/s", "cost if run serially with a durable write"], rows)
        + f"\n\n(durable write rate: the raw floor's median, {durable_gbps:.2f} GB/s)"
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="tensor bytes to save")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of save and load")
    parser.add_argument("--threads", type=int, default=1, help="thread_count of both writers")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results file")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size_bytes = int(args.size_gib * (1 << 30))
    results: dict[str, Any] = {
        "args": vars(args),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": describe_machine(str(work)),
    }
    print("warming up", flush=True)
    warm_up(work, args.threads)
    state = make_state(size_bytes)
    results["payload_bytes"] = tensor_bytes(state)
    print(f"saving {format_size(results['payload_bytes'])}, {args.rounds} rounds", flush=True)
    results["save"] = bench_saves(state, work, args.threads, args.rounds)
    results["checksum_variants"] = bench_checksum_variants(state, work, args.threads)
    print("loading", flush=True)
    results["load"], target = bench_loads(state, work, args.threads, args.rounds)
    del state, target
    print("zstd", flush=True)
    results["zstd"] = bench_zstd(size_bytes, work, args.threads)
    print("checksums", flush=True)
    results["checksums"] = bench_checksums(max(3, args.rounds))
    results["load_average"] = os.getloadavg()
    return results


def save_json(path: Path, results: dict[str, Any]) -> Path:
    """Merge this run into ``path`` under ``runs["threads=N"]``."""
    import json

    merged: dict[str, Any] = {"runs": {}}
    if path.exists():
        try:
            merged = json.loads(path.read_text())
            merged.setdefault("runs", {})
        except (OSError, ValueError):
            merged = {"runs": {}}
    merged["runs"][f"threads={results['args']['threads']}"] = results
    return write_results(path, merged)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(
        "bench_storage_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: save_json(Path(args.out), r),
    )


if __name__ == "__main__":
    sys.exit(main())
