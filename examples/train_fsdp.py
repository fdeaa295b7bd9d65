"""Train a small FSDP2-sharded model under torchrun, checkpoint with dcp_safe, resume on restart.

Run (two ranks on CPU with gloo; with CUDA, NCCL for the model and gloo for the checkpoint's
CPU collectives)::

    torchrun --nproc_per_node=2 examples/train_fsdp.py --root ckpts --steps 6 --save-every 2

Run it again with a larger ``--steps`` and it resumes from the newest committed checkpoint
(``--replicate-to s3://bucket/run`` also copies every checkpoint there and restores from there
when the local root has nothing). Each save is asynchronous: the loop waits only for the staged
copy (``BudgetedStager``) before the next optimizer step; the write and the two-phase commit
run in the background, one save in flight at a time.

The data are a pure function of (step, rank), so a resumed run computes exactly what an
uninterrupted one would: the script prints a digest of the full model and optimizer state at
each save, at resume and at the end, for comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dcp_safe
from dcp_safe import BudgetedStager, SafeStorageReader, SafeStorageWriter

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8


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


def newest_checkpoint(root: str, replicate_to: str | None) -> str | None:
    """Rank 0 looks (local root, then the replica); every rank gets its answer."""
    found: list[str | None] = [None]
    if dist.get_rank() == 0:
        for tier in (root, replicate_to):
            names = [] if tier is None else [c.name for c in dcp_safe.list_checkpoints(tier)]
            if names:
                found[0] = max(names)  # zero-padded step names sort by step
                break
    dist.broadcast_object_list(found, src=0)
    return found[0]


def resume(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> int:
    """Load the newest checkpoint into the sharded model and optimizer; return its step."""
    name = newest_checkpoint(args.root, args.replicate_to)
    if name is None:
        return 0
    state = app_state(model, optimizer, step=-1)
    reader = SafeStorageReader(args.root, fallback=args.replicate_to)
    dcp_safe.load(state, checkpoint_id=name, storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded = digest(app_state(model, optimizer, state["step"]))
    log(f"resumed from {name} at step {state['step']} (state digest {loaded})")
    return int(state["step"])


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


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
    start = resume(model, optimizer, args)

    writer = SafeStorageWriter(args.root, replicate_to=args.replicate_to)
    stager = BudgetedStager()
    in_flight: Any = None
    last_saved: str | None = None
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.save_every == 0:
            if in_flight is not None:
                in_flight.upload_completion.result()  # one save in flight per writer
            state = app_state(model, optimizer, step)
            last_saved = f"step_{step:06d}"
            in_flight = dcp_safe.async_save(
                state, checkpoint_id=last_saved, storage_writer=writer, async_stager=stager
            )
            stager.track(in_flight)
            in_flight.staging_completion.result()  # from here the next step may change the state
            log(
                f"step {step}: loss {loss.item():.5f}, saving {last_saved} "
                f"(state digest {digest(state)})"
            )
    if in_flight is not None and last_saved is not None:
        in_flight.upload_completion.result()
        log(f"committed {last_saved}")
        if args.replicate_to is not None:
            writer.replication(last_saved).result(timeout=600)
            log(f"replicated {last_saved} to {args.replicate_to}")
    writer.close(timeout_s=600)
    stager.close()
    final = digest(app_state(model, optimizer, args.steps))
    log(f"done at step {args.steps} (state digest {final})")
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
    args = parser.parse_args()
    if args.steps < 0 or args.save_every < 1:
        parser.error("--steps must be >= 0 and --save-every >= 1")
    # DCP warns about its own internals (e.g. the staging path); they are not this script's.
    warnings.filterwarnings("ignore", category=FutureWarning)
    train(args)


if __name__ == "__main__":
    main()
