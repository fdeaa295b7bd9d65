"""After its first save, a ``CheckpointManager`` runs no collective on the training group.

The training loop owns the default process group: a collective a save puts there waits on, and
delays, the training's own. The manager's votes and saves run on its own gloo groups
(:mod:`dcp_safe.coordination.groups`), and a save of an unchanged layout reuses the cached plan
(docs/architecture.md, "Cached save plans"). Checked on 2 real gloo ranks by wrapping every
``torch.distributed`` collective and recording the group each call used, over several saves of
a sharded and replicated state.
"""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import ready_worker
from torch.distributed import distributed_c10d as c10d
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_safe import Bounds, CheckpointManager, Runtime, list_checkpoints
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.worker_process, pytest.mark.multiproc, pytest.mark.timeout(300)]

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


class _GroupLog:
    """Every collective this process calls, as (name, "default" or "other"), in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        for name in _COLLECTIVES:
            original = getattr(c10d, name)
            wrapper = self._wrap(name, original)
            setattr(c10d, name, wrapper)  # what c10d's own functions call
            setattr(dist, name, wrapper)  # what DCP and dcp_safe call

    def _wrap(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        def recording(*args: Any, **kwargs: Any) -> Any:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            default = name == "new_group" or group is None or group is c10d._get_default_group()
            with self._lock:
                self.calls.append((name, "default" if default else "other"))
            return original(*args, **kwargs)

        return recording

    def mark(self) -> int:
        with self._lock:
            return len(self.calls)

    def on_default_since(self, mark: int) -> list[str]:
        with self._lock:
            return [name for name, group in self.calls[mark:] if group == "default"]


def _state(world_size: int, step: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(step)
    return {
        "w": distribute_tensor(torch.randn(16, 8, generator=gen), mesh, [Shard(0)]),
        "bias": distribute_tensor(torch.randn(8, generator=gen), mesh, [Replicate()]),
        "layers": {f"l{i}": torch.full((4, 4), float(step + i)) for i in range(8)},
        "meta": {"step": step},
    }


def _saves(rank: int, world_size: int, root: str, executor: str) -> dict[str, Any]:
    planned = {"n": 0}
    original = DefaultSavePlanner.create_global_plan

    def counting(planner: DefaultSavePlanner, plans: Any) -> Any:
        planned["n"] += 1
        return original(planner, plans)

    DefaultSavePlanner.create_global_plan = counting  # type: ignore[method-assign]
    log = _GroupLog()
    with CheckpointManager(
        root, bounds=Bounds(deadline_s=20.0), runtime=Runtime(executor=executor)
    ) as manager:
        if executor == "process":  # saves run on a thread until the worker is ready
            ready_worker(manager)
        manager.save(1, _state(world_size, 1))  # states built before the marks: a mesh is
        manager.wait(timeout_s=120)  # made on the default group, by the training side
        states = [_state(world_size, step) for step in range(2, 6)]
        after_first = log.mark()
        for step, state in enumerate(states, start=2):
            handle = manager.save(step, state)
            assert handle is not None
            handle.committed.result(timeout=120)
        on_default = log.on_default_since(after_first)
        elsewhere = log.mark() - after_first - len(on_default)
    return {"on_default": on_default, "elsewhere": elsewhere, "planned": planned["n"]}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_after_the_first_save_no_collective_runs_on_the_training_group(
    tmp_path: Path, executor: str
) -> None:
    results = run_ranks(_saves, 2, args=(str(tmp_path), executor))
    for result in results:
        assert result["on_default"] == []
        assert result["elsewhere"] > 0  # the saves' collectives ran, on the manager's groups
    # The coordinator planned the first save only; the workers plan in their own processes.
    assert results[0]["planned"] == (1 if executor == "thread" else 0)
    assert [c.name for c in list_checkpoints(tmp_path)][-1].endswith("5")
