"""Quickstart: save a model with dcp_safe, list and verify the checkpoints, load the latest.

Run: ``python examples/quickstart.py [ROOT]`` (a temporary directory by default).
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

import dcp_safe
from dcp_safe import BudgetedStager, SafeStorageReader, SafeStorageWriter, WriterOptions


def main(root: str) -> None:
    # Single process here: DCP warns that it assumes so even when told no_dist=True.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = SafeStorageWriter(root, options=WriterOptions(compression="zstd"))
    # Staged copies go into a reusable, budgeted pool: the 2nd save allocates no new memory.
    stager = BudgetedStager()

    for step in range(1, 4):
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
        response = dcp.async_save(
            state,
            checkpoint_id=f"step_{step:06d}",
            storage_writer=writer,
            async_stager=stager,
            no_dist=True,
        )
        stager.track(response)  # return the buffers to the pool as soon as the upload ends
        response.staging_completion.result()  # safe to mutate the model from here on
        response.upload_completion.result()  # committed on disk
        stats = stager.stats()
        print(
            f"step {step}: loss {loss.item():.4f}, committed step_{step:06d} "
            f"(pool {stats.pool_bytes // 1024} KiB, "
            f"{stats.allocations} buffers allocated in all, "
            f"{stats.reuses} reused)"
        )
    stager.close()

    print(f"\ncommitted checkpoints under {root}:")
    for info in dcp_safe.list_checkpoints(root):
        print(f"  {info.name}  {info.size_bytes / 1024:8.1f} KiB  world size {info.world_size}")

    report = dcp_safe.verify_checkpoint(root, "latest")
    print(f"\nverified {report.name}: {report.files_checked} files, {report.items_checked} items")

    restored = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
    )
    target = {"model": restored.state_dict()}
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=SafeStorageReader(root))
    restored.load_state_dict(target["model"])
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), restored.parameters(), strict=True)
    )
    print(f"loaded latest into a fresh model: parameters identical = {same}")
    if not same:
        raise SystemExit("restore check failed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", help="checkpoint root (default: a temporary dir)")
    args = parser.parse_args()
    if args.root:
        main(args.root)
    else:
        with tempfile.TemporaryDirectory(prefix="dcp_safe_quickstart_") as tmp:
            main(tmp)
