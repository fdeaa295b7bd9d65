"""The benchmark sweep: dcp_safe against DCP's own async paths and the hardware floors.

Usage::

    .venv/bin/python benchmarks/sweep.py run --part sizes --sizes-mib 256,1024,4096 --rounds 3
    .venv/bin/python benchmarks/sweep.py run --part s3 --sizes-mib 256,1024 --rounds 3
    .venv/bin/python benchmarks/sweep.py run --part counts --counts 10,100,1000,10000
    .venv/bin/python benchmarks/sweep.py run --part compression --sizes-mib 1024
    .venv/bin/python benchmarks/sweep.py render     # docs/benchmarks.md + docs/benchmarks/*.png

Each ``run`` is one process: every contender of a point (a size, a tensor count) runs once per
round, in an order rotated from round to round, and medians are reported, because the machine
is shared. The measuring code is the quick pass's (:mod:`dcp_safe.bench`): a *session* per
contender (cold save, warm save, two back-to-back requests; see
:mod:`dcp_safe.bench.session`), the copy and raw-write floors of :mod:`dcp_safe.bench.floors`,
and for S3 the moto server, the boto3 multipart floor and the object clean-up of
``bench_s3.py``.

Contenders (all through ``dcp.async_save``; fsync on for local writers):

* ``dcp_safe``: an unpinned ``BudgetedStager`` + ``SafeStorageWriter``;
* ``torch_default_async``: ``FileSystemWriter(sync_files=True)``, no stager (DCP's default);
* ``torch_default_stager``: ``DefaultStager`` with CPU options (async staging, no pinning);
* ``torch_blocking_cached``: ``BlockingAsyncStager(cache_staged_state_dict=True)``;
* S3: ``dcp_safe_replicated`` (local root + ``replicate_to``), ``dcp_safe_s3`` (an ``s3://``
  root), ``torch_fsspec`` (``FsspecWriter``, DCP's default async path) and the ``boto3``
  multipart floor, all against one moto server in a child process.

Results go to ``benchmarks/results/sweep-<part>.json``; ``render`` reads them all.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import run_and_report, write_results

from dcp_safe import Root, WriterOptions
from dcp_safe.bench.floors import (
    checksum_rate,
    copy_floor_s,
    load_s,
    raw_write_floor_s,
    zstd_rate,
)
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
from dcp_safe.bench.savers import DcpSafeSaver, Saver, TorchSaver, TorchStaging
from dcp_safe.bench.session import remove_tree, run_session

RESULTS = Path(__file__).resolve().parent / "results"
SIZE_TENSORS = 16  # tensors of the size sweep's state (64 MiB each at 1 GiB)
COUNT_SIZE_MIB = 256  # total size of the tensor-count sweep


@dataclass(frozen=True)
class Spec:
    """One contender of a point.

    Attributes:
        name: the contender's name in the results.
        make: builds a saver in a folder (a session contender), or
        run: times a floor in a folder (seconds), one of the two.
        reader: ``(folder, checkpoint name) -> (reader, checkpoint_id)`` to time a load.
        saves: sequential saves per session.
        pair: also request two saves back to back.
        cleanup: ``(folder) -> (name) -> None``; default removes ``folder/name``.
    """

    name: str
    make: Callable[[Path], Saver] | None = None
    run: Callable[[Path], float] | None = None
    reader: Callable[[Path, str], tuple[Any, str | None]] | None = None
    saves: int = 2
    pair: bool = True
    cleanup: Callable[[Path], Callable[[str], None]] = remove_tree


def run_point(
    specs: list[Spec], state: State, work: Path, rounds: int, sampler: RssSampler, label: str
) -> dict[str, Any]:
    """Every spec once per round in rotated order; loads after each round.

    One untimed raw write and copy of the state come first: the first gigabytes a process
    writes after allocating its state cost several times more system time on this kind of
    guest (fresh pages), and would always land on whichever contender goes first.
    """
    warm = work / "_warm"
    raw_write_floor_s(state, warm)
    remove_tree(work)("_warm")
    copy_floor_s(state, repeats=1)
    per_round: list[dict[str, Any]] = []
    orders = []
    failed: dict[str, str] = {}
    for r in range(rounds):
        order = rotate([s.name for s in specs], r)
        orders.append(order)
        by_name = {s.name: s for s in specs}
        out: dict[str, Any] = {}
        for name in order:
            spec = by_name[name]
            folder = work / name
            folder.mkdir(exist_ok=True)
            t0 = time.perf_counter()
            out[name] = _run_spec(spec, state, folder, r, sampler, failed)
            print(f"  {label} round {r} {name:24s} {time.perf_counter() - t0:7.2f} s", flush=True)
        for spec in specs:
            if spec.reader is None or spec.name in failed:
                continue
            folder, last = work / spec.name, f"{spec.name}_r{r}_{spec.saves}"
            reader, checkpoint_id = spec.reader(folder, last)
            out[f"load:{spec.name}"] = load_s(state, reader, checkpoint_id)
            spec.cleanup(folder)(last)
        per_round.append(out)
    return {"rounds": per_round, "orders": orders, "summary": summarize(per_round)}


def _run_spec(
    spec: Spec, state: State, folder: Path, r: int, sampler: RssSampler, failed: dict[str, str]
) -> Any:
    """One contender in round ``r``: a session, or a floor."""
    if spec.name in failed:
        return {"error": failed[spec.name]}
    if spec.run is not None:
        return spec.run(folder)
    make = spec.make
    assert make is not None

    def session() -> dict[str, Any]:
        return run_session(
            lambda: make(folder),
            state,
            names=lambda i: f"{spec.name}_r{r}_{i}",
            sampler=sampler,
            saves=spec.saves,
            pair=spec.pair,
            cleanup=spec.cleanup(folder),
            keep_last=spec.reader is not None,
        )

    return _guarded(failed, spec.name, session)


def _guarded(failed: dict[str, str], name: str, fn: Callable[[], Any]) -> Any:
    """Run a contender; one that cannot run here is recorded (and skipped from then on)."""
    try:
        return fn()
    except Exception as exc:  # reported in the results and the docs, never hidden
        failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"  {name} cannot run here: {failed[name]}", flush=True)
        return {"error": failed[name]}


def summarize(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians across rounds, per contender (sessions) or per floor (seconds)."""
    summary: dict[str, Any] = {}
    for name, first in per_round[0].items():
        values = [r[name] for r in per_round]
        if isinstance(first, (int, float)):
            summary[name] = median(values)
            continue
        if any("error" in v for v in values):
            summary[name] = {"error": next(v["error"] for v in values if "error" in v)}
            continue
        saves = [v["saves"] for v in values]
        last = [s[-1] for s in saves]
        entry = {
            "first_stall_s": median(s[0]["stall_s"] for s in saves),
            "first_alloc_bytes": median(s[0]["alloc_bytes"] for s in saves),
            "stall_s": median(x["stall_s"] for x in last),
            "local_commit_s": median(x["local_commit_s"] for x in last),
            "write_s": median(x["local_commit_s"] - x["stall_s"] for x in last),
            "alloc_bytes": median(x["alloc_bytes"] for x in last),
            "peak_over_state_bytes": median(
                max(x["peak_over_state_bytes"] for x in s) for s in saves
            ),
        }
        if "remote_commit_s" in last[0]:
            entry["remote_commit_s"] = median(x["remote_commit_s"] for x in last)
            entry["upload_after_local_s"] = median(
                x["remote_commit_s"] - x["local_commit_s"] for x in last
            )
        if "pair" in values[0]:
            for key in ("second_stall_s", "both_committed_s", "peak_over_state_bytes"):
                entry[f"pair_{key}"] = median(v["pair"][key] for v in values)
        summary[name] = entry
    return summary


# ----------------------------------------------------------------------------- local points


def _safe_reader(folder: Path, name: str) -> tuple[Any, str | None]:
    from dcp_safe.adapters.reader import SafeStorageReader

    return SafeStorageReader(folder), name


def _torch_reader(folder: Path, name: str) -> tuple[Any, str | None]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(folder / name), None


def local_specs(
    *, pair: bool = True, stager_pair: bool = True, zstd: bool = False, blocking: bool = True
) -> list[Spec]:
    """dcp_safe and DCP's three CPU staging paths (``stager_pair``: also DCP's stagers'
    back-to-back pair, which is only informative, not a target)."""
    comp = "zstd" if zstd else "none"
    specs = [
        Spec(
            "dcp_safe",
            make=lambda f: DcpSafeSaver(f, compression=comp),
            pair=pair,
            reader=_safe_reader,
        ),
        Spec(
            "torch_default_async",
            make=lambda f: TorchSaver(f, zstd=zstd),
            pair=pair,
            reader=_torch_reader,
        ),
        Spec(
            "torch_default_stager",
            pair=pair and stager_pair,
            make=lambda f: TorchSaver(f, staging=TorchStaging.DEFAULT_STAGER, zstd=zstd),
        ),
    ]
    if blocking:
        specs.append(
            Spec(
                "torch_blocking_cached",
                pair=pair,
                make=lambda f: TorchSaver(f, staging=TorchStaging.BLOCKING_CACHED, zstd=zstd),
            )
        )
    return specs


def floor_specs(state: State) -> list[Spec]:
    def raw(folder: Path) -> float:
        seconds = raw_write_floor_s(state, folder / "raw")
        remove_tree(folder)("raw")
        return seconds

    return [Spec("copy_floor", run=lambda _f: copy_floor_s(state)), Spec("raw_floor", run=raw)]


def part_sizes(args: argparse.Namespace, work: Path, sampler: RssSampler) -> dict[str, Any]:
    points: dict[str, Any] = {}
    for size_mib in args.sizes:
        state = make_state(size_mib * MIB, SIZE_TENSORS)
        large = size_mib >= 4096
        rounds = args.rounds_large if large else args.rounds
        specs = local_specs(stager_pair=not large) + floor_specs(state)
        point = run_point(specs, state, work, rounds, sampler, f"{size_mib} MiB")
        point["payload_bytes"] = tensor_bytes(state)
        point["tensors"] = SIZE_TENSORS
        point["checksum_rate_bps"] = checksum_rate(state)
        points[str(size_mib)] = point
        args.checkpoint(points)
        del state
    return points


def part_counts(args: argparse.Namespace, work: Path, sampler: RssSampler) -> dict[str, Any]:
    points: dict[str, Any] = {}
    for count in args.counts:
        state = make_state(args.count_size_mib * MIB, count)
        specs = local_specs(pair=False, blocking=False) + floor_specs(state)
        point = run_point(specs, state, work, args.rounds, sampler, f"{count} tensors")
        point["payload_bytes"] = tensor_bytes(state)
        point["tensors"] = count
        points[str(count)] = point
        args.checkpoint(points)
    return points


def part_compression(args: argparse.Namespace, work: Path, sampler: RssSampler) -> dict[str, Any]:
    size_mib = args.sizes[0]
    state = make_state(size_mib * MIB, SIZE_TENSORS, compressible=True, seed=1)
    specs = [
        Spec("dcp_safe", make=lambda f: DcpSafeSaver(f), pair=False),
        Spec(
            "dcp_safe_zstd",
            make=lambda f: DcpSafeSaver(f, compression="zstd"),
            pair=False,
            reader=_safe_reader,
        ),
        Spec(
            "torch_default_async_zstd",
            make=lambda f: TorchSaver(f, zstd=True),
            pair=False,
            reader=_torch_reader,
        ),
        *floor_specs(state),
    ]
    point = run_point(specs, state, work, args.rounds, sampler, f"{size_mib} MiB compressible")
    point["payload_bytes"] = tensor_bytes(state)
    point["tensors"] = SIZE_TENSORS
    point["zstd_rate_bps"] = zstd_rate(state)
    point["checksum_rate_bps"] = checksum_rate(state)
    point["shard_bytes"] = _zstd_shard_bytes(state, work)
    return {str(size_mib): point}


def _zstd_shard_bytes(state: State, work: Path) -> dict[str, int]:
    """Bytes on disk of one zstd save by dcp_safe and by torch (the compression achieved)."""
    import shutil

    from torch.distributed.checkpoint.state_dict_saver import save

    from dcp_safe.adapters.writer import SafeStorageWriter

    out = {}
    save(
        state,
        checkpoint_id="z",
        storage_writer=SafeStorageWriter(work / "zs", options=WriterOptions(compression="zstd")),
        no_dist=True,
    )
    out["dcp_safe_zstd"] = sum(p.stat().st_size for p in (work / "zs").rglob("*.distcp"))
    writer = TorchSaver(work / "zt", zstd=True).writer_for("z")
    save(state, storage_writer=writer, no_dist=True)
    out["torch_zstd"] = sum(p.stat().st_size for p in (work / "zt").rglob("*.distcp"))
    shutil.rmtree(work / "zs")
    shutil.rmtree(work / "zt")
    return out


# ----------------------------------------------------------------------------- S3


@contextlib.contextmanager
def _s3() -> Iterator[tuple[Any, Any]]:
    import bench_s3

    with bench_s3.moto_server() as (s3, server):
        s3.create_bucket(bench_s3.BUCKET)
        yield s3, server


def s3_specs(state: State, s3: Any, read_timeout_s: float) -> list[Spec]:
    import bench_s3

    client = s3.client()
    opts = s3.storage_options(config_kwargs={"read_timeout": read_timeout_s})
    url = f"s3://{bench_s3.BUCKET}"

    def s3_cleanup(prefix: str) -> Callable[[Path], Callable[[str], None]]:
        def for_folder(folder: Path) -> Callable[[str], None]:
            local = remove_tree(folder)

            def cleanup(name: str) -> None:
                local(name)
                bench_s3.delete_prefix(client, f"{prefix}/{name}")

            return cleanup

        return for_folder

    def boto3_floor(folder: Path) -> float:
        upload = bench_s3.make_contenders(state, folder, s3, read_timeout_s)["boto3_c1"]
        start = time.perf_counter()
        upload.run("boto3")
        seconds = time.perf_counter() - start
        stored = bench_s3.stored_summary(client, "boto3")
        bench_s3.check_stored("boto3", "boto3", stored, tensor_bytes(state))
        bench_s3.delete_prefix(client, "boto3")
        return seconds

    return [
        Spec(
            "dcp_safe_replicated",
            pair=False,
            cleanup=s3_cleanup("rep"),
            make=lambda f: DcpSafeSaver(f, replicate_to=Root(f"{url}/rep", storage_options=opts)),
        ),
        Spec(
            "dcp_safe_s3",
            pair=False,
            cleanup=s3_cleanup("direct"),
            make=lambda f: DcpSafeSaver(Root(f"{url}/direct", storage_options=opts)),
        ),
        Spec(
            "torch_fsspec",
            pair=False,
            cleanup=s3_cleanup("fsspec"),
            make=lambda f: TorchSaver(Root(f"{url}/fsspec", storage_options=opts)),
        ),
        Spec("boto3_floor", run=boto3_floor),
    ]


def part_s3(args: argparse.Namespace, work: Path, sampler: RssSampler) -> dict[str, Any]:
    points: dict[str, Any] = {}
    with _s3() as (s3, server):
        warm = make_state(8 * MIB, 4)
        run_point(s3_specs(warm, s3, args.read_timeout), warm, work, 1, sampler, "warm-up")
        for size_mib in args.sizes:
            state = make_state(size_mib * MIB, SIZE_TENSORS)
            specs = s3_specs(state, s3, args.read_timeout)
            point = run_point(specs, state, work, args.rounds, sampler, f"S3 {size_mib} MiB")
            point["payload_bytes"] = tensor_bytes(state)
            point["tensors"] = SIZE_TENSORS
            point["moto_rss_bytes"] = int(server.memory_info().rss)
            points[str(size_mib)] = point
            args.checkpoint(points)
    return points


# ----------------------------------------------------------------------------- main

PARTS = {
    "sizes": part_sizes,
    "counts": part_counts,
    "compression": part_compression,
    "s3": part_s3,
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure one part")
    run.add_argument("--part", choices=sorted(PARTS), required=True)
    run.add_argument("--sizes-mib", dest="sizes", type=_ints, default=[256, 1024, 4096])
    run.add_argument("--counts", type=_ints, default=[10, 100, 1000, 10000])
    run.add_argument("--count-size-mib", type=int, default=COUNT_SIZE_MIB)
    run.add_argument("--rounds", type=int, default=3)
    run.add_argument("--rounds-large", type=int, default=3, help="rounds at >= 4 GiB")
    run.add_argument("--read-timeout", type=float, default=300.0)
    run.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    run.add_argument("--out", default=None, help="default results/sweep-<part>.json")
    render = sub.add_parser("render", help="write docs/benchmarks.md and the plots")
    render.add_argument("--results", default=str(RESULTS))
    render.add_argument("--docs", default=str(Path(__file__).resolve().parent.parent / "docs"))
    return parser.parse_args(argv)


def run_part(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    """Run one part; the results file is rewritten after every point, so a part stopped
    early (a deadline) keeps the points it finished."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = describe_machine()

    def result(points: dict[str, Any]) -> dict[str, Any]:
        return {
            "part": args.part,
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "args": {k: v for k, v in vars(args).items() if k not in ("command", "checkpoint")},
            "started_at": started,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine,
            "machine_after": describe_machine(),
            "points": points,
        }

    args.checkpoint = lambda points: write_results(out, result(points))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with RssSampler() as sampler:
            points = PARTS[args.part](args, work, sampler)
    return result(points)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "render":
        import sweep_report

        return sweep_report.render(Path(args.results), Path(args.docs))
    out = Path(args.out or RESULTS / f"sweep-{args.part}.json")
    return run_and_report(
        f"sweep_{args.part}_",
        args.dir,
        lambda work: run_part(args, work, out),
        lambda r: (
            f"{r['part']}: {len(r['points'])} point(s), {r['started_at']} .. {r['finished_at']}"
        ),
        lambda r: write_results(out, r),
    )


if __name__ == "__main__":
    sys.exit(main())
