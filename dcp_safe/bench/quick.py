"""``dcp-safe bench``: a quick pass (about a minute) of dcp_safe against DCP's defaults.

At a small size (``--size-mib``, default 256) it measures, in one process with the order of
contenders rotated from round to round:

* dcp_safe: ``BudgetedStager`` + ``SafeStorageWriter`` through ``dcp.async_save``;
* torch: ``dcp.async_save`` with ``FileSystemWriter(sync_files=True)`` and no stager (DCP's
  default async path: the writer stages a fresh copy, blocking);
* floors: ``copy_`` into preallocated buffers, and a raw sequential write + fsync;
* loads: ``SafeStorageReader`` (verifying) against ``FileSystemReader``.

It prints ratios (dcp_safe over the alternative or the floor), writes them with ``--json``, and
with ``--compare PREVIOUS.json`` exits 1 if any ratio worsened by more than ``--tolerance``
(relative). That comparison is the regression guard; no figure here is checked against a fixed
number of seconds, because the machines it runs on are shared.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader

from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.bench.compare import compare_ratios, make_ratio, unmatched
from dcp_safe.bench.floors import copy_floor_s, load_s, raw_write_floor_s
from dcp_safe.bench.measure import (
    MIB,
    RssSampler,
    State,
    describe_machine,
    make_state,
    median,
    rotate,
    tensor_bytes,
)
from dcp_safe.bench.savers import DcpSafeSaver, TorchSaver
from dcp_safe.bench.session import remove_tree, run_session
from dcp_safe.cli_args import OneLineParser
from dcp_safe.errors import ConfigError
from dcp_safe.host_memory import available_bytes_now

SCHEMA = "dcp_safe.bench.quick/1"
CONTENDERS = ("dcp_safe", "torch_default_async", "raw_floor", "copy_floor")
TENSORS = 8


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dcp-safe bench", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=256.0, help="state size (MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (order rotates)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--json", dest="json_path", default=None, help="write ratios here")
    parser.add_argument("--compare", default=None, help="a previous --json to compare with")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.25,
        help="relative worsening of a ratio that --compare flags (default 0.25 = 25%%)",
    )
    return parser


def _round(state: State, work: Path, r: int, sampler: RssSampler) -> dict[str, Any]:
    """One round: every contender once, in rotated order; then the two loads."""
    out: dict[str, Any] = {}
    cleanup = remove_tree(work)
    for name in rotate(CONTENDERS, r):
        if name == "dcp_safe":
            out[name] = run_session(
                lambda: DcpSafeSaver(work),
                state,
                names=lambda i: f"safe_r{r}_{i}",
                sampler=sampler,
                cleanup=cleanup,
                keep_last=True,
            )
        elif name == "torch_default_async":
            out[name] = run_session(
                lambda: TorchSaver(work),
                state,
                names=lambda i: f"torch_r{r}_{i}",
                sampler=sampler,
                cleanup=cleanup,
                keep_last=True,
            )
        elif name == "raw_floor":
            out[name] = raw_write_floor_s(state, work / f"raw_r{r}")
            cleanup(f"raw_r{r}")
        else:
            out[name] = copy_floor_s(state)
    out["load_dcp_safe"] = load_s(state, SafeStorageReader(work), f"safe_r{r}_2")
    out["load_torch"] = load_s(state, FileSystemReader(work / f"torch_r{r}_2"))
    cleanup(f"safe_r{r}_2")
    cleanup(f"torch_r{r}_2")
    return out


def _medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    def saves(name: str, i: int, key: str) -> float:
        return median(r[name]["saves"][i][key] for r in rounds)

    med: dict[str, float] = {}
    for name in ("dcp_safe", "torch_default_async"):
        med[f"{name}.first_stall_s"] = saves(name, 0, "stall_s")
        med[f"{name}.stall_s"] = saves(name, 1, "stall_s")
        med[f"{name}.local_commit_s"] = saves(name, 1, "local_commit_s")
        med[f"{name}.alloc_bytes"] = saves(name, 1, "alloc_bytes")
        med[f"{name}.peak_over_state_bytes"] = max(
            s["peak_over_state_bytes"] for r in rounds for s in r[name]["saves"]
        )
        med[f"{name}.pair_peak_over_state_bytes"] = max(
            r[name]["pair"]["peak_over_state_bytes"] for r in rounds
        )
        med[f"{name}.pair_second_stall_s"] = median(
            r[name]["pair"]["second_stall_s"] for r in rounds
        )
    for key in ("raw_floor", "copy_floor", "load_dcp_safe", "load_torch"):
        med[f"{key}_s"] = median(r[key] for r in rounds)
    return med


def ratios_of(med: dict[str, float], payload: int) -> dict[str, dict[str, Any]]:
    """The quick pass's ratios from its medians (see the module docstring)."""
    safe, torch_ = "dcp_safe", "torch_default_async"
    return {
        "stall_vs_torch_default_async": make_ratio(
            med[f"{safe}.stall_s"] / med[f"{torch_}.stall_s"],
            "lower",
            "second-save stall, dcp_safe / torch async_save default (target <= 0.5)",
        ),
        "stall_vs_copy_floor": make_ratio(
            med[f"{safe}.stall_s"] / med["copy_floor_s"],
            "lower",
            "second-save stall / copy_ into preallocated buffers (target <= 1.2)",
        ),
        "local_commit_vs_filesystemwriter": make_ratio(
            med[f"{safe}.local_commit_s"] / med[f"{torch_}.local_commit_s"],
            "lower",
            "time to local commit, dcp_safe / FileSystemWriter (target <= 1.15)",
        ),
        "raw_floor_vs_local_commit": make_ratio(
            med["raw_floor_s"] / med[f"{safe}.local_commit_s"],
            "higher",
            "durable-write throughput as a fraction of raw write + fsync (target >= 0.8)",
        ),
        "load_vs_filesystemreader": make_ratio(
            med["load_dcp_safe_s"] / med["load_torch_s"],
            "lower",
            "verified load, SafeStorageReader / FileSystemReader",
        ),
        "peak_rss_over_generation": make_ratio(
            med[f"{safe}.peak_over_state_bytes"] / payload,
            "lower",
            "peak RSS above the resident state, in generations (target <= 1.1)",
        ),
        "pair_peak_rss_over_generation": make_ratio(
            med[f"{safe}.pair_peak_over_state_bytes"] / payload,
            "lower",
            "the same with two back-to-back save requests (target <= 1.1)",
        ),
    }


def run_quick(size_bytes: int, rounds: int, work: Path) -> dict[str, Any]:
    """Run the quick pass in ``work`` and return its result (``"ratios"`` included)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = describe_machine()
    state = make_state(size_bytes, TENSORS)
    payload = tensor_bytes(state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with RssSampler() as sampler:
            per_round = [_round(state, work, r, sampler) for r in range(rounds)]
    med = _medians(per_round)
    return {
        "schema": SCHEMA,
        "started_at": started,
        "machine": machine,
        "payload_bytes": payload,
        "tensors": TENSORS,
        "rounds": rounds,
        "orders": [rotate(CONTENDERS, r) for r in range(rounds)],
        "medians": med,
        "ratios": ratios_of(med, payload),
        "per_round": per_round,
    }


def _report(result: dict[str, Any]) -> str:
    lines = [
        f"dcp-safe bench: {result['payload_bytes'] / MIB:.0f} MiB in {result['tensors']} "
        f"tensors, {result['rounds']} rounds, ratios of medians from this run",
        "",
    ]
    width = max(len(n) for n in result["ratios"])
    for name, entry in result["ratios"].items():
        lines.append(f"  {name:<{width}}  {entry['value']:7.3f}  {entry['description']}")
    med = result["medians"]
    lines += [
        "",
        "  medians: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k.endswith("_s")),
    ]
    return "\n".join(lines)


def _compare(result: dict[str, Any], path: str, tolerance: float) -> int:
    previous = json.loads(Path(path).read_text())
    found = compare_ratios(previous, result, tolerance)
    for note in unmatched(previous, result):
        print(f"  not compared: {note}")
    if not found:
        print(f"compare: no ratio worsened by more than {100 * tolerance:.0f}% against {path}")
        return 0
    print(f"compare: {len(found)} ratio(s) worsened beyond tolerance against {path}:")
    for regression in found:
        print(f"  REGRESSION {regression.message(tolerance)}")
    return 1


def main(argv: list[str]) -> int:
    """Run the quick pass; return 0, or 1 when ``--compare`` finds a regression, 2 on misuse."""
    args = _parser().parse_args(argv)
    if not (args.size_mib > 0 and args.rounds >= 1):
        print("dcp-safe bench: --size-mib must be > 0 and --rounds >= 1", file=sys.stderr)
        return 2
    if not args.size_mib * MIB < available_bytes_now():  # inf, or a state this host cannot hold
        print("dcp-safe bench: --size-mib is more than this host's free memory", file=sys.stderr)
        return 2
    if args.compare is not None and not Path(args.compare).is_file():
        print(f"dcp-safe bench: --compare {args.compare}: no such file", file=sys.stderr)
        return 2
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        print("dcp-safe bench: --tolerance must be a number >= 0", file=sys.stderr)
        return 2
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dcp_safe_bench_", dir=args.dir))
    try:
        result = run_quick(int(args.size_mib * MIB), args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["command"] = " ".join(["dcp-safe", "bench", *argv])
    print(_report(result))
    if args.json_path is not None:
        out = Path(args.json_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"\nresults: {out}")
    if args.compare is not None:
        try:
            return _compare(result, args.compare, args.tolerance)
        except (ConfigError, ValueError) as exc:
            print(f"dcp-safe bench: cannot compare with {args.compare}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
