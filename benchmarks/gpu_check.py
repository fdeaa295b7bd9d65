"""GPU check: device-to-host staging with BudgetedStager's pinned pool vs DCP and ``.cpu()``.

Run unattended on a CUDA machine: ``python benchmarks/gpu_check.py [--size-gib 2]``. For one
state on the GPU it times device-to-host staging three ways -- BudgetedStager (pinned pool,
warmed, then two saves), DCP's ``DefaultStager`` (pinned, async, non-blocking; two saves) and a
plain ``.cpu()`` per tensor -- prints the figures, and checks every staged byte against the
source. Exit status: 0 when all bytes match (or when no GPU is at hand: it says so and skips),
1 when any staged byte differs. Bounded well under five minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _state(size_gib: float) -> dict[str, Any]:
    import torch

    total = int(size_gib * (1 << 30))
    g = torch.Generator(device="cuda").manual_seed(0)
    big = {
        f"layer{i}.weight": torch.randn(total // 16 // 4, device="cuda", generator=g)
        for i in range(8)
    }
    bf16 = {
        f"layer{i}.bf16": torch.randn(total // 16 // 2, device="cuda", generator=g).to(
            torch.bfloat16
        )
        for i in range(8)
    }
    small = {f"small{i}": torch.randint(0, 1 << 30, (257,), device="cuda") for i in range(512)}
    return {"big": big, "bf16": bf16, "small": small, "step": 7}


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def _mismatches(staged: Any, source: Any) -> int:
    import torch

    bad = 0
    for s, src in zip(_tensors(staged), _tensors(source), strict=True):
        if s.device.type != "cpu" or s.dtype != src.dtype or s.shape != src.shape:
            bad += 1
            continue
        # Compare raw bytes on the GPU: equal bit patterns, NaNs included.
        a = s.to("cuda").contiguous().view(torch.uint8)
        b = src.contiguous().view(torch.uint8)
        bad += int(not torch.equal(a, b))
    return bad


def _timed(fn: Any) -> tuple[float, Any]:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; skipped")
        return 0
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_safe.staging import BudgetedStager

    state = _state(args.size_gib)
    nbytes = sum(t.nbytes for t in _tensors(state))
    print(
        f"gpu_check: {torch.cuda.get_device_name()} torch {torch.__version__},"
        f" state {nbytes / (1 << 30):.2f} GiB in {len(_tensors(state))} tensors"
    )
    rows: list[tuple[str, float, float]] = []
    failures = 0

    stager = BudgetedStager(pin_memory="auto", timeout_s=120)
    warm_s, _ = _timed(lambda: stager.warm_up(state))
    for i in (1, 2):
        seconds, staged = _timed(lambda: stager.stage(state).result())
        failures += _mismatches(staged, state)
        rows.append((f"BudgetedStager pinned pool, save {i}", seconds, nbytes / seconds))
        del staged
    stats = stager.stats()
    stager.close()
    print(
        f"  BudgetedStager: warm_up {warm_s:.3f}s, pinned {stats.pinned_bytes / (1 << 30):.2f}"
        f" GiB, allocations {stats.allocations}, reuses {stats.reuses}"
    )

    # Pinned, async, non-blocking; no shared memory (/dev/shm is small in many containers).
    default = DefaultStager(StagingOptions(True, False, True, True))
    for i in (1, 2):
        seconds, staged = _timed(lambda: default.stage(state).result())  # type: ignore[union-attr]
        failures += _mismatches(staged, state)
        rows.append((f"DCP DefaultStager pinned, save {i}", seconds, nbytes / seconds))
        del staged
    default.close()

    for i in (1, 2):
        seconds, staged = _timed(
            lambda: {
                k: {n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v
                for k, v in state.items()
            }
        )
        failures += _mismatches(staged, state)
        rows.append((f"plain .cpu(), run {i}", seconds, nbytes / seconds))
        del staged

    print("| method | seconds | GB/s |\n|---|---:|---:|")
    for name, seconds, rate in rows:
        print(f"| {name} | {seconds:.3f} | {rate / 1e9:.2f} |")
    print(f"gpu_check: {failures} mismatching tensor(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
