"""The peer tier: restore time and bytes per source, and time to the first step after a node loss.

Usage::

    .venv/bin/python benchmarks/bench_peer_restore.py [--nodes 2] [--ranks-per-node 2]
        [--state 4x16MiB] [--rounds 3] [--dir D]

Real gloo ranks on this host (``dcp_safe.testing.multiproc.run_ranks``) stand for
``--nodes`` x ``--ranks-per-node`` ranks (``LOCAL_WORLD_SIZE`` set, each node its own folder);
the remote is a bucket of a local moto S3 server (``dcp_safe.testing.s3``, read over HTTP). One
``CheckpointManager(Topology.of(remote, node_local=..., peer_copies=2))`` save of a state of
``COUNTxSIZE`` float32 tensors, each sharded across the ranks (DTensor ``Shard(0)``), then,
alternating from round to round, three restarts of the same checkpoint:

* ``intact``: every node's cache is there (peer tier on);
* ``node lost, peers``: node 1's folder replaced by an empty one, ``peer_copies=2``;
* ``node lost, no peers``: the same loss, ``peer_copies=1`` (today: node 1's share from S3).

Each restart, on every rank, from a barrier: build the manager, ``restore()``, one training
step (a matmul and an all-reduce), a barrier; rank 0's time is the job's time to its first step
(process start excluded). Before each, the node folders are dropped from the page cache, as
after a reboot. Bytes per source: the sum over ranks of ``last_reader.stats()``. Every restore
is checked exactly. Also the save: the time to the S3 commit, and then to the peer copies'
end. Medians over rounds. Results: ``benchmarks/results/bench_peer_restore-<time>.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe_machine, evict, markdown_table, median, rotate, write_results

from dcp_safe import CheckpointManager, Topology
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.reading.sources import ReadSource
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.units import format_size

RESULTS = Path(__file__).resolve().parent / "results"
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
SCENARIOS = ("intact", "node lost, peers", "node lost, no peers")
LOST = 1  # the node replaced by an empty one


def parse_state(text: str) -> tuple[int, int]:
    """``"4x16MiB"`` -> (4, 16 MiB)."""
    found = re.fullmatch(r"(\d+)x(\d+)(KiB|MiB|GiB)", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"a state is COUNTxSIZE, e.g. 4x16MiB, not {text!r}")
    return int(found[1]), int(found[2]) * UNITS[found[3]]


def _full(count: int, size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(size // 4, generator=gen) for i in range(count)}


def _sharded(full: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def _manager(remote: str, options: Any, node: str, copies: int) -> CheckpointManager:
    topology = Topology.of(remote, node_local=node, peer_copies=copies, storage_options=options)
    return CheckpointManager(topology, keep_last=2)


def _save(remote: str, options: Any, node: str, full: dict[str, torch.Tensor]) -> dict[str, float]:
    with _manager(remote, options, node, 2) as manager:
        dist.barrier()
        start = time.perf_counter()
        handle = manager.save(1, _sharded(full))
        assert handle is not None
        handle.committed.result(timeout=3600)
        committed = time.perf_counter() - start
        manager.wait(timeout_s=3600)  # the peer copies
        copied = time.perf_counter() - start
        dist.barrier()
    return {"commit_s": committed, "peers_done_s": copied}


def _restart(
    remote: str, options: Any, node: str, copies: int, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    target = _sharded({k: torch.zeros_like(v) for k, v in full.items()})
    dist.barrier()
    start = time.perf_counter()
    manager = _manager(remote, options, node, copies)
    manager.restore(target)
    first = next(iter(target.values())).to_local()
    loss = (first @ first).reshape(1)  # one training step: some compute, one collective
    dist.all_reduce(loss)
    dist.barrier()
    elapsed = time.perf_counter() - start
    reader = manager.last_reader
    manager.close()
    for key, value in full.items():
        if not torch.equal(target[key].full_tensor(), value):
            raise AssertionError(f"{key} was not restored exactly")
    assert isinstance(reader, SafeStorageReader)
    stats = reader.stats()
    return {
        "s": elapsed,
        "bytes": {s.value: stats.bytes_from(s) for s in ReadSource},
        "files": {s.value: stats.files_from(s) for s in ReadSource},
        "rejections": len(stats.rejections),
    }


def _rank(
    rank: int,
    world_size: int,
    remote: str,
    options: Any,
    nodes: list[str],
    per_node: int,
    count: int,
    size: int,
    rounds: int,
) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    node = nodes[rank // per_node]
    full = _full(count, size)
    saved = _save(remote, options, node, full)
    runs: list[dict[str, Any]] = []
    aside = Path(nodes[LOST] + ".aside")
    for round_ in range(rounds):
        for scenario in rotate(list(SCENARIOS), round_):
            lost = scenario != "intact"
            if rank == 0:
                if lost:  # a replaced node: an empty disk (the old one is kept for later)
                    os.rename(nodes[LOST], aside)
                    os.makedirs(nodes[LOST])
                for folder in nodes:
                    evict(Path(folder))
            copies = 1 if scenario == "node lost, no peers" else 2
            run = _restart(remote, options, node, copies, full)
            runs.append({"scenario": scenario, **run})
            dist.barrier()
            if rank == 0 and lost:
                shutil.rmtree(nodes[LOST])
                os.rename(aside, nodes[LOST])
    return {"save": saved, "runs": runs}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from dcp_safe.testing.s3 import local_s3

    count, size = parse_state(args.state)
    nodes = [str(work / f"node_{n}") for n in range(args.nodes)]
    world = args.nodes * args.ranks_per_node
    load_before = os.getloadavg()
    with local_s3() as s3:
        remote = f"s3://{s3.create_bucket()}/run"
        per_rank = run_ranks(
            _rank,
            world,
            args=(
                remote,
                s3.storage_options(),
                nodes,
                args.ranks_per_node,
                count,
                size,
                args.rounds,
            ),
            timeout_s=3600,
        )
    rows = []
    for scenario in SCENARIOS:
        picked = [[r for r in ranks["runs"] if r["scenario"] == scenario] for ranks in per_rank]
        total = {
            kind: {
                s.value: median(
                    [sum(p[i][kind][s.value] for p in picked) for i in range(args.rounds)]
                )
                for s in ReadSource
            }
            for kind in ("bytes", "files")
        }
        rows.append(
            {
                "scenario": scenario,
                "median_s": median([r["s"] for r in picked[0]]),  # rank 0's, barrier to barrier
                "bytes": total["bytes"],
                "files": total["files"],
            }
        )
    return {
        "machine": describe_machine(str(work)),
        "torch": torch.__version__,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "state": args.state,
        "rounds": args.rounds,
        "save": per_rank[0]["save"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }


def report(results: dict[str, Any]) -> str:
    base = next(r["median_s"] for r in results["rows"] if r["scenario"] == "node lost, no peers")
    lines = [
        [
            r["scenario"],
            f"{r['median_s']:.3f}",
            f"{r['median_s'] / base:.2f}",
            *(
                f"{format_size(int(r['bytes'][s.value]))} ({int(r['files'][s.value])})"
                for s in ReadSource
            ),
        ]
        for r in results["rows"]
    ]
    headers = [
        "restart",
        "to first step, s",
        "x no peers",
        "own cache (files)",
        "peers (files)",
        "S3 (files)",
    ]
    load = ", ".join(f"{x:.1f}" for x in results["load_average_before"])
    save = results["save"]
    return (
        f"{results['nodes']} nodes x {results['ranks_per_node']} ranks, {results['state']} sharded,"
        f" moto S3, load average {load}; save: S3 commit {save['commit_s']:.3f} s, peer copies"
        f" done {save['peers_done_s']:.3f} s\n" + markdown_table(headers, lines)
    )


def main(argv: list[str] | None = None) -> int:
    from _common import run_and_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--state", default="4x16MiB", type=lambda s: parse_state(s) and s)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return run_and_report(
        "bench_peer_restore_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(RESULTS / f"bench_peer_restore-{stamp}.json", r),
    )


if __name__ == "__main__":
    sys.exit(main())
