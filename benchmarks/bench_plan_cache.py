"""Where a save's planning time goes, with and without cached plans (#30, item 2).

Usage::

    .venv/bin/python benchmarks/bench_plan_cache.py --world-size 2 --tensors 10000 --saves 5
    .venv/bin/python benchmarks/bench_plan_cache.py --world-size 2 --no-cache

Every rank saves the same state (``--tensors`` float32 tensors of 32 KiB, equal on every rank)
``--saves`` times through ``dcp_safe.save`` to a fresh folder (``/dev/shm`` by default), with
``SafeSavePlanner(cache_plans=...)``. Timed on rank 0 by wrapping the methods DCP calls: each
rank's local plan (its layout, and the values: fingerprints and audit sums), rank 0's global
plan, DCP's whole plan phase (``_DistWrapper.reduce_scatter``: local plans, gather, global plan,
scatter), the committer's two metadata encodings and the whole save; and the pickled size of
the plan each rank gathers to rank 0 and of the plans rank 0 scatters back. Prints the first
save and the median of the later ones. docs/architecture.md, "Cached save plans".
"""

from __future__ import annotations

import argparse
import collections
import inspect
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch.distributed.checkpoint import utils as dcp_utils
from torch.distributed.checkpoint.planner import SavePlan

import dcp_safe
import dcp_safe.commit.committer as committer
from dcp_safe import SafeSavePlanner, SafeStorageWriter
from dcp_safe.testing.multiproc import run_ranks

_TIMES: dict[str, list[float]] = collections.defaultdict(list)
_BYTES: dict[str, list[int]] = collections.defaultdict(list)


def _timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _TIMES[label].append(time.perf_counter() - start)

    wrapper.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _instrument() -> None:
    _timed(SafeSavePlanner, "create_local_plan", "local plan (layout and values)")
    _timed(SafeSavePlanner, "create_global_plan", "rank 0's global plan")
    _timed(dcp_utils._DistWrapper, "reduce_scatter", "plan phase (reduce_scatter)")
    _timed(committer, "dcp_metadata", "commit: .metadata pickled")
    _timed(committer, "plain_dcp_metadata", "commit: plain metadata")
    gather, scatter = dcp_utils._DistWrapper.gather_object, dcp_utils._DistWrapper.scatter_object

    def gather_object(wrapper: Any, obj: Any) -> Any:
        if isinstance(obj, SavePlan):
            _BYTES["plan gathered, one rank"].append(len(pickle.dumps(obj)))
        return gather(wrapper, obj)

    def scatter_object(wrapper: Any, objs: Any) -> Any:
        if objs is not None and isinstance(objs[0], SavePlan):
            _BYTES["plans scattered, all ranks"].append(sum(len(pickle.dumps(o)) for o in objs))
        return scatter(wrapper, objs)

    dcp_utils._DistWrapper.gather_object = gather_object  # type: ignore[method-assign]
    dcp_utils._DistWrapper.scatter_object = scatter_object  # type: ignore[method-assign]


def run(rank: int, world_size: int, root: str, tensors: int, saves: int, cache: bool) -> str:
    _instrument()
    torch.manual_seed(0)  # the same values on every rank: replicated, not divergent
    state = {f"layer{i}.w": torch.randn(8192) for i in range(tensors)}
    for step in range(saves):
        start = time.perf_counter()
        dcp_safe.save(
            state,
            checkpoint_id=f"step_{step}",
            storage_writer=SafeStorageWriter(root),
            planner=SafeSavePlanner(cache_plans=cache),
        )
        _TIMES["save"].append(time.perf_counter() - start)
    lines = [f"world size {world_size}, {tensors} tensors of 32 KiB, cache_plans={cache}"]
    for label, times in _TIMES.items():
        later = statistics.median(times[1:]) if len(times) > 1 else float("nan")
        lines.append(f"  {label:32s} first {times[0] * 1e3:8.0f} ms   later {later * 1e3:8.0f} ms")
    for label, sizes in _BYTES.items():
        lines.append(f"  {label:32s} first {sizes[0]:9d} B    later {sizes[-1]:9d} B")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_plan_cache_")
    params = (root, args.tensors, args.saves, not args.no_cache)
    try:
        if args.world_size == 1:
            print(run(0, 1, *params))
        else:
            print(run_ranks(run, args.world_size, args=params, timeout_s=1800)[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
