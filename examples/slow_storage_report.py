"""Storage slower than the save interval: what ``when_busy="skip"`` actually commits.

A tiny model trains 40 steps of ~0.05 s and asks for a checkpoint every step, while every
upload takes ~0.3 s (a writer whose ``write_data`` sleeps). The report compares requested with
committed cuts, counts skips, and compares the peak host RSS (sampled in a thread) with the
stager's budget envelope. Run: ``python examples/slow_storage_report.py [ROOT] [--fallback]``
(``--fallback`` leaves the automatic switch to synchronous saves on; by default it is off so the
report shows plain skipping).
"""

from __future__ import annotations

import sys
import tempfile
import time
from typing import Any

import torch

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.bench.measure import RssSampler
from dcp_safe.manager import Bounds, CheckpointManager, Runtime, SavePolicy
from dcp_safe.manager.fallback import FallbackOptions
from dcp_safe.staging import MemoryBudget
from dcp_safe.staging.budget import format_bytes

STEPS = 40
STEP_S = 0.05
WRITE_S = 0.3


class SlowWriter(SafeStorageWriter):
    """A writer whose every save spends ``WRITE_S`` more in ``write_data``."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(WRITE_S)
        return super().write_data(plan, planner)


def main(root: str, fallback: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model.state_dict()}
    budget = MemoryBudget.from_host()
    sampler = RssSampler(interval_s=0.01).start()
    manager = CheckpointManager(
        root,
        when_busy="skip",
        keep_last=3,
        policy=SavePolicy(sync_fallback=FallbackOptions(enabled=fallback)),
        bounds=Bounds(budget=budget),
        runtime=Runtime(writer=SlowWriter(root)),
    )
    started = time.monotonic()
    with manager:
        for step in range(1, STEPS + 1):
            step_started = time.monotonic()
            loss = model(torch.randn(32, 256)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            manager.maybe_save(step, state)
            time.sleep(max(0.0, STEP_S - (time.monotonic() - step_started)))
    elapsed = time.monotonic() - started
    sampler.stop()
    history = manager.history()
    committed = [e["step"] for e in history if e["event"] == "committed" and e["tier"] == "local"]
    skipped = [e["step"] for e in history if e["event"] == "skipped"]
    fallbacks = [e for e in history if e["event"] == "fallback"]
    stats = manager.stats()
    print(f"steps {STEPS} x {STEP_S} s, upload {WRITE_S} s per save, wall {elapsed:.2f} s")
    print(f"requested cuts: {stats.requested}")
    print(f"committed cuts: {len(committed)} -> steps {committed}")
    print(f"skipped: {len(skipped)} (async started {stats.started}, sync {stats.sync_saves})")
    for event in fallbacks:
        print(f"fallback at step {event['step']}: {event['reason']}")
    peak, baseline = format_bytes(sampler.peak_bytes), format_bytes(sampler.baseline_bytes)
    print(f"peak host RSS {peak} (baseline {baseline})")
    print(f"budget: {budget.explain()}")
    print(f"peak stager pool {format_bytes(manager.stager.stats().peak_pool_bytes)}")
    within = sampler.peak_delta_bytes <= budget.envelope_bytes
    print(f"RSS growth within envelope = {within}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    with tempfile.TemporaryDirectory() as tmp:
        main(args[0] if args else tmp, "--fallback" in sys.argv)
