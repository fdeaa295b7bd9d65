"""The demo behind ``dcp-safe demo``: train, checkpoint asynchronously to two tiers, restore.

It owns one end-to-end run that shows what dcp_safe is for, measured rather than claimed: a small
model trains on the CPU; every few steps a :class:`~dcp_safe.manager.CheckpointManager` (with a
:class:`~dcp_safe.staging.BudgetedStager`) saves it asynchronously to a local root replicated to
S3 (an in-process moto server unless ``remote`` names a real one). Before each async save the
same state is saved synchronously to a scratch directory, so the training stall of both is
measured in the same run, on the same disk, under the same load. Host memory is sampled
throughout. At the end the newest checkpoint is restored from the S3 tier alone and compared
with the live state, bit for bit.

Why a synchronous dcp_safe save as the baseline rather than stock DCP: it writes the same bytes
with the same checksums and commit, so the difference is the staging alone.

The report it fills in, and how that is printed, live in :mod:`dcp_safe.demo.report` (re-exported
here, so ``dcp_safe.demo`` keeps its public names).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dcp_safe import layout
from dcp_safe.adapters import api
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.checkpoints.catalog import list_checkpoints
from dcp_safe.demo.report import DemoReport, SaveRecord
from dcp_safe.errors import ConfigError
from dcp_safe.manager import CheckpointManager
from dcp_safe.manager.options import Runtime, SavePolicy
from dcp_safe.staging import BudgetedStager, MemoryBudget
from dcp_safe.telemetry import MemorySampler
from dcp_safe.telemetry.memory import ProcReader
from dcp_safe.topology import Root, RootLike, Topology, as_root

Say = Callable[[str], None]

NAME_FORMAT = "step_{step:06d}"


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What the demo runs.

    Args:
        root: the local root (default: a new temporary directory, kept afterwards).
        remote: the replica root, e.g. ``s3://bucket/run``, or a ``Root`` with its fsspec
            options (endpoint, credentials) (default: a bucket on an in-process moto S3 server,
            gone when the demo ends).
        storage_options: the shorthand of ``Root(remote, storage_options=...)``.
        steps: training steps.
        save_every: a checkpoint every this many steps (and one at the last step).
        width: hidden width of the model (its state grows with the square of it).
        seed: the random seed of the model and the data.

    Raises:
        ConfigError: a value out of range.
    """

    root: str | None = None
    remote: RootLike | None = None
    storage_options: dict[str, Any] | None = None
    steps: int = 40
    save_every: int = 5
    width: int = 768
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "save_every", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


class _Trainer:
    """A small MLP learning a fixed random teacher: real optimizer state, real gradients."""

    def __init__(self, width: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.inputs = 128
        self.model = _mlp(self.inputs, width)
        self.teacher = _mlp(self.inputs, width)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batch = 256

    def step(self) -> float:
        x = torch.randn(self.batch, self.inputs)
        with torch.no_grad():
            y = self.teacher(x)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    def state(self, step: int) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "step": step,
        }


def _mlp(inputs: int, width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, inputs),
    )


def run_demo(options: DemoOptions, say: Say = print) -> DemoReport:
    """Run the demo; ``say`` gets one line per event as it happens.

    Returns:
        The report; ``restore_ok`` says whether the state restored from the remote tier alone
        equals the live state.

    Raises:
        DcpSafeError: a save, replication or restore failed (the error says which and why).
        ConfigError: no ``remote`` was given and moto (the test extra) is not installed.
    """
    started = time.perf_counter()
    with _remote_tier(options, say) as (remote, note):
        root = options.root or tempfile.mkdtemp(prefix="dcp_safe_demo_")
        report = DemoReport(root=root, remote=remote.url, remote_note=note)
        trainer = _Trainer(options.width, options.seed)
        _train_and_save(trainer, options, report, remote, say)
        report.local = list_checkpoints(root)
        report.remote_checkpoints = list_checkpoints(remote)
        _restore_from_remote(trainer, options.steps, report, remote, say)
    report.seconds = time.perf_counter() - started
    return report


@contextlib.contextmanager
def _remote_tier(options: DemoOptions, say: Say) -> Iterator[tuple[Root, str]]:
    if options.remote is not None:
        yield as_root(options.remote, options.storage_options), "as given"
        return
    try:
        from dcp_safe.testing.s3 import start_local_s3
    except ImportError as exc:  # pragma: no cover - moto is in the test extra
        raise ConfigError(
            f"the demo's local S3 needs moto ({exc}); install the test extra"
            " (pip install 'dcp-safe[test]') or pass --remote s3://bucket/prefix"
        ) from None
    s3 = start_local_s3()
    try:
        bucket = s3.create_bucket("dcp-safe-demo")
        remote = f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"
        say(f"local S3 (moto) at {s3.endpoint_url}; replica root {remote}")
        note = f"in-process moto S3 at {s3.endpoint_url}: gone when the demo exits"
        yield Root(remote, s3.storage_options()), note
    finally:
        s3.stop()


def _train_and_save(
    trainer: _Trainer,
    options: DemoOptions,
    report: DemoReport,
    remote: Root,
    say: Say,
) -> None:
    budget = MemoryBudget.from_host()
    # Shared memory, so the default executor can hand the staged copies to its worker process.
    stager = BudgetedStager(budget, shared_memory=True)
    report.budget = budget
    # The sampler's own reader, so "before" and "peak" are the same figure (VmRSS).
    report.rss_before_bytes = ProcReader().read(rollup=False)["rss_bytes"] or 0
    sampler = MemorySampler(busy_interval_s=0.01, idle_interval_s=0.05)
    report.memory_source = "dcp_safe.telemetry.MemorySampler, every 10 ms"
    scratch = tempfile.mkdtemp(prefix=".dcp_safe_demo_sync_", dir=_scratch_parent(report.root))
    manager = CheckpointManager(
        Topology.of(report.root, replicate_to=remote),
        keep_last=2,
        when_busy="wait",
        policy=SavePolicy(name_format=NAME_FORMAT),
        runtime=Runtime(stager=stager),
    )
    report.executor = manager.executor
    try:
        with sampler, sampler.busy():
            _loop(trainer, options, manager, scratch, report, say)
            manager.close()
        report.rss_peak_bytes = sampler.peak("rss_bytes") or 0
        available = [s.host_available_bytes for s in sampler.samples()]
        report.host_available_min_bytes = min((a for a in available if a is not None), default=0)
    finally:
        manager.close()
        report.stats = manager.stats()
        report.pool_peak_bytes = stager.stats().peak_pool_bytes
        stager.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _scratch_parent(root: str) -> str | None:
    """Beside a local root (same disk, fair comparison); the system temp dir otherwise."""
    if "://" in root and not root.startswith("file://"):
        return None
    return os.path.dirname(os.path.abspath(root.removeprefix("file://")))


def _loop(
    trainer: _Trainer,
    options: DemoOptions,
    manager: CheckpointManager,
    scratch: str,
    report: DemoReport,
    say: Say,
) -> None:
    for step in range(1, options.steps + 1):
        loss = trainer.step()
        last = step == options.steps
        if step % options.save_every and not last:
            continue
        state = trainer.state(step)
        record = SaveRecord(step=step, name=NAME_FORMAT.format(step=step), sync_s=0.0)
        record.sync_s = _timed_sync_save(state, scratch, record.name)
        _async_save(manager, state, record, force=last)
        report.saves.append(record)
        report.bytes_per_save = _tensor_bytes(state)
        say(
            f"step {step:4d}  loss {loss:.4f}  {record.name}: training stall"
            f" {record.async_stall_s * 1e3:7.1f} ms async vs {record.sync_s * 1e3:7.1f} ms sync"
        )


def _timed_sync_save(state: dict[str, Any], scratch: str, name: str) -> float:
    started = time.perf_counter()
    api.save(state, checkpoint_id=name, storage_writer=SafeStorageWriter(scratch), no_dist=True)
    seconds = time.perf_counter() - started
    shutil.rmtree(os.path.join(scratch, name))
    return seconds


def _async_save(
    manager: CheckpointManager, state: dict[str, Any], record: SaveRecord, *, force: bool
) -> None:
    started = time.perf_counter()
    handle = manager.save(record.step, state, force=force)
    if handle is None:
        record.remote = "skipped (busy)"
        return
    handle.staged.result()
    record.async_stall_s = time.perf_counter() - started

    def committed(_: Any) -> None:
        record.local_commit_s = time.perf_counter() - started

    def replicated(done: Any) -> None:
        if done.cancelled() or done.exception() is not None:
            error = "cancelled" if done.cancelled() else done.exception()
            name = type(error).__name__
            record.remote = "skipped" if name == "ReplicationSkippedError" else f"failed: {error}"
            return
        record.remote, record.remote_commit_s = "committed", time.perf_counter() - started

    handle.committed.add_done_callback(committed)
    handle.replicated.add_done_callback(replicated)


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _restore_from_remote(
    trainer: _Trainer,
    step: int,
    report: DemoReport,
    remote: Root,
    say: Say,
) -> None:
    live = trainer.state(step)
    target = _blank_like(live)
    reader = SafeStorageReader(remote)
    say(f"restoring {layout.LATEST!r} from {report.remote} alone (the local root is not read)")
    api.load(target, checkpoint_id=layout.LATEST, storage_reader=reader, no_dist=True)
    report.restored = reader.checkpoint_id or layout.LATEST
    report.mismatches = _differences(target, live)
    report.restored_tensors = _count_tensors(live)
    report.restore_ok = not report.mismatches


def _blank_like(tree: Any) -> Any:
    """The same structure with every tensor zeroed and every number scrambled."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _blank_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_blank_like(v) for v in tree]
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return -1
    return copy.deepcopy(tree)


def _differences(actual: Any, expected: Any, path: str = "") -> list[str]:
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
        return [] if same and torch.equal(actual, expected) else [path or "<root>"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return [path or "<root>"]
        found: list[str] = []
        for key, value in expected.items():
            found += _differences(actual[key], value, f"{path}.{key}" if path else str(key))
        return found
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [path]
        return [
            d for i, v in enumerate(expected) for d in _differences(actual[i], v, f"{path}[{i}]")
        ]
    return [] if actual == expected else [path]


def _count_tensors(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, dict):
        return sum(_count_tensors(v) for v in tree.values())
    if isinstance(tree, list):
        return sum(_count_tensors(v) for v in tree)
    return 0


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the request log of the in-process S3 server and DCP's single-process warning."""
    server_log = logging.getLogger("werkzeug")
    level = server_log.level
    server_log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        server_log.setLevel(level)
