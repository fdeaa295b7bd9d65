"""Train a small FSDP2-sharded model under torchrun, checkpoint with CheckpointManager, resume.

Run (two ranks on CPU with gloo; with CUDA, NCCL for the model and gloo for the checkpoint's
CPU collectives)::

    torchrun --nproc_per_node=2 examples/train_fsdp.py --root ckpts --steps 6 --save-every 2

Every rank creates one ``dcp_safe.CheckpointManager`` with the same arguments and makes the
same calls with it: ``restore`` once at start (the newest committed checkpoint of the local
root, else of ``--replicate-to``; resharded to this world size), ``maybe_save`` after every
optimizer step, ``close`` at the end. Each save is one multi-rank DCP checkpoint, saved
asynchronously: ``maybe_save`` returns once the state is copied into the budgeted staging
buffers, while the write, the two-phase commit, verification and retention run in the
background, one save in flight at a time. What happens to a request that finds a save still in
flight is ``--when-busy`` (the ranks agree on it): wait for it, skip it, coalesce, or save
synchronously. Run it again with a larger ``--steps`` and it resumes where it left off.

The data are a pure function of (step, rank), so a resumed run computes exactly what an
uninterrupted one would: the script prints a digest of the full model and optimizer state at
each save, at resume and at the end, for comparison. At the end it prints the manager's
counters (requested, committed, skipped, synchronous saves) and, for each rank, the staging
pool's peak against that rank's share of the node's memory budget, and the peak RSS.

To see storage slower than the save interval, ``--slow-write-ms`` makes every item written
sleep (a demonstration knob, not a setting of dcp_safe) and ``--step-ms`` adds simulated
compute per step; e.g. ``--steps 40 --save-every 2 --step-ms 50 --when-busy skip
--slow-write-ms 5`` skips the requests that arrive while a save is still being written.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import resource
import statistics
import time
import warnings
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_safe import (
    CheckpointManager,
    CheckpointNotFoundError,
    Runtime,
    SafeStorageWriter,
    Topology,
)

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8


class SlowStorageWriter(SafeStorageWriter):
    """Demonstration only: a writer that sleeps ``delay_s`` before each item it writes."""

    def __init__(self, *args: Any, delay_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    def _write_item(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay_s)
        return super()._write_item(*args, **kwargs)


def build(device: torch.device, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same initial weights on every rank, then sharded by FSDP2 (each layer, then the root)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x, y = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)
    return x.to(device), y.to(device)


def app_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def digest(state: dict[str, Any]) -> str:
    """SHA-256 of every tensor gathered whole, in key order (a collective: every rank calls it)."""
    hasher = hashlib.sha256()

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(f"{prefix}.{key}", value[key])
        elif isinstance(value, DTensor | torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            hasher.update(prefix.encode())
            hasher.update(full.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())

    visit("", {"model": state["model"], "optim": state["optim"]["state"]})
    return hasher.hexdigest()[:16]


def resume(manager: CheckpointManager, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint into the sharded model and optimizer; return its step."""
    state = app_state(model, optimizer, step=-1)
    try:
        name = manager.restore(state)  # rank 0 resolves "latest"; every rank loads its shards
    except CheckpointNotFoundError:
        log("no checkpoint yet: starting at step 0")
        return 0
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded = digest(app_state(model, optimizer, state["step"]))
    log(f"resumed from {name} at step {state['step']} (state digest {loaded})")
    return int(state["step"])


def size(nbytes: int) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, four significant digits."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.4g} {unit}"
        value /= 1024
    return f"{value:.4g} GiB"


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def make_manager(args: argparse.Namespace) -> CheckpointManager:
    """The same arguments on every rank, at the same point: construction is a collective."""
    writer = None
    if args.slow_write_ms > 0:
        writer = SlowStorageWriter(
            args.root, replicate_to=args.replicate_to, delay_s=args.slow_write_ms / 1000
        )
    return CheckpointManager(
        Topology.of(args.root, replicate_to=args.replicate_to),  # the same as ``writer``'s
        keep_last=args.keep_last,
        when_busy=args.when_busy,
        save_every=args.save_every,
        runtime=Runtime(writer=writer),
    )


def timing(history: list[dict[str, Any]], since: float) -> str:
    """Median gap between save requests and median save time, from this run's history."""
    events = [e for e in history if e.get("time", 0.0) >= since]
    requested = {e["name"]: e["time"] for e in events if e["event"] == "requested"}
    took = [
        e["time"] - requested[e["name"]]
        for e in events
        if e["event"] == "committed" and e["name"] in requested
    ]
    times = sorted(requested.values())
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    if not gaps or not took:
        return "too few saves to time"
    return (
        f"save interval {statistics.median(gaps):.3f} s, a save took "
        f"{statistics.median(took):.3f} s (medians; request to verified local commit)"
    )


def report(manager: CheckpointManager, rss_at_start: int, since: float) -> None:
    """Rank 0 prints the manager's counters, then one line per rank about its memory."""
    if dist.get_rank() == 0:
        print(timing(manager.history(), since), flush=True)  # rank 0 writes the history
    stats = manager.stats()
    log(
        f"saves: requested {stats.requested}, committed {stats.committed}, "
        f"skipped {stats.skipped}, coalesced {stats.coalesced}, sync saves {stats.sync_saves}, "
        f"failed {stats.failed}, waits expired {stats.waits_expired}, "
        f"fallback {stats.fallback_reason or 'none'}"
    )
    budget, staged = manager.stager.budget, manager.stager.stats()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    mine = (
        f"rank {dist.get_rank()}: peak staging pool {size(staged.peak_pool_bytes)} "
        f"of its envelope {size(budget.envelope_bytes)} (share {budget.share:.3g} of the "
        f"node envelope {size(budget.node_envelope_bytes)}); "
        f"within = {staged.peak_pool_bytes <= budget.envelope_bytes}; "
        f"peak RSS {size(peak_rss)} "
        f"(+{size(max(0, peak_rss - rss_at_start))} since training started)"
    )
    lines: list[str] | None = [""] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, lines, dst=0)
    for line in lines or ():
        print(line, flush=True)


def train(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    # One group, two backends: NCCL for the model's CUDA tensors, gloo for DCP's CPU collectives.
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model, optimizer = build(device, mesh)
    manager = make_manager(args)
    start = resume(manager, model, optimizer)
    rss_at_start, since = psutil.Process().memory_info().rss, time.time()

    saved_last = False
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_ms / 1000)  # the rest of a real step's compute
        state = app_state(model, optimizer, step)
        # Returns once the state is copied (the next step may change it), or None: not due or
        # skipped. Every rank gets the same answer.
        handle = manager.maybe_save(step, state)
        saved_last = handle is not None
        if handle is not None:
            log(
                f"step {step}: loss {loss.item():.5f}, saving {handle.name} "
                f"(state digest {digest(state)})"
            )
        elif step % args.save_every == 0:
            reason = next(
                e.get("reason", "")
                for e in reversed(manager.decisions())
                if e["event"] == "skipped" and e["step"] == step
            )
            log(f"step {step}: loss {loss.item():.5f}, save skipped ({reason})")
    if start < args.steps and not saved_last:
        # The final state (not due, or its request skipped) must not be lost: force waits for
        # the save in flight, whatever --when-busy says.
        state = app_state(model, optimizer, args.steps)
        handle = manager.save(args.steps, state, force=True)
        assert handle is not None
        log(f"final save {handle.name} (state digest {digest(state)})")
    manager.close(timeout_s=600)  # waits for the last commit (and replication), prunes
    log(f"committed {manager.latest()}")
    if args.replicate_to is not None:
        log(f"replicated {manager.latest('remote')} to {args.replicate_to}")
    final = digest(app_state(model, optimizer, args.steps))
    log(f"done at step {args.steps} (state digest {final})")
    report(manager, rss_at_start, since)
    # Both ranks leave together: a rank tearing its connections down while its peer is still
    # inside a collective makes the peer's gloo threads abort it.
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint root (a local directory)")
    parser.add_argument("--steps", type=int, default=6, help="train until this step")
    parser.add_argument("--save-every", type=int, default=2, help="checkpoint every K steps")
    parser.add_argument("--replicate-to", default=None, help="second root, e.g. s3://bucket/run")
    parser.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep (retention)")
    parser.add_argument(
        "--when-busy",
        default="wait",
        choices=["wait", "skip", "coalesce", "sync"],
        help="what a save request does while the previous save is still being written",
    )
    parser.add_argument(
        "--slow-write-ms",
        type=float,
        default=0.0,
        help="DEMONSTRATION ONLY: sleep this long per item written, to make storage slower "
        "than the save interval (0: the ordinary writer)",
    )
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="simulated compute per step, in milliseconds"
    )
    args = parser.parse_args()
    if args.steps < 0 or args.save_every < 1 or args.keep_last < 1:
        parser.error("--steps must be >= 0, --save-every and --keep-last >= 1")
    if args.slow_write_ms < 0 or args.step_ms < 0:
        parser.error("--slow-write-ms and --step-ms must be >= 0")
    # DCP warns about its own internals (e.g. the staging path); they are not this script's.
    warnings.filterwarnings("ignore", category=FutureWarning)
    train(args)


if __name__ == "__main__":
    main()
