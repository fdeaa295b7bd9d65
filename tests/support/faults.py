"""Writers that fail, die, stall or record where a test says, and a payload whose unpickling runs
code.

Module level, so that they pickle by reference into spawned ranks and DCP's checkpoint process
(a child finds ``support`` as its parent did: ``sys.path`` travels with a spawn).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import dcp_safe
from dcp_safe import SafeStorageWriter

from .states import make_state


class DiesInWriteData(SafeStorageWriter):
    """Storage that fails at once in ``write_data``: the save is abandoned, its partial kept."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(5, "Input/output error (injected)")


def abandon_a_save(root: Path, name: str, seed: int = 0) -> str:
    """Save ``make_state(seed)`` as ``name`` through ``DiesInWriteData``: the save fails and
    leaves its partial behind. Returns the partial's name."""
    with pytest.raises(dcp_safe.CommitError):
        dcp_safe.save(make_state(seed), checkpoint_id=name, storage_writer=DiesInWriteData(root))
    return next(e for e in os.listdir(root) if e.startswith(f".{name}"))


class DiesMidWrite(SafeStorageWriter):
    """On the ``victim`` rank, signals its own process right after the first item is streamed
    (of every save, or only of the save of step ``at_step``)."""

    def __init__(
        self,
        root: str,
        *,
        victim: int,
        signum: int = signal.SIGKILL,
        at_step: int | None = None,
    ) -> None:
        super().__init__(root)
        self.victim = victim
        self.signum = signum
        self.at_step = at_step

    def _write_item(self, sink: Any, file_name: str, item: Any, planner: Any) -> Any:
        record = super()._write_item(sink, file_name, item, planner)
        if self._rank == self.victim and (self.at_step is None or self.step == self.at_step):
            os.kill(os.getpid(), self.signum)  # SIGSTOP stops every thread of the rank
        return record


class StopsInWorker(DiesMidWrite):
    """SIGSTOPs the checkpoint worker mid-write in the save of step ``at_step``; never the
    process that built it (a save that ran on the thread path is left alone)."""

    def __init__(self, root: str, *, at_step: int) -> None:
        super().__init__(root, victim=0, signum=signal.SIGSTOP, at_step=at_step)
        self.builder = os.getpid()

    def _write_item(self, sink: Any, file_name: str, item: Any, planner: Any) -> Any:
        if os.getpid() == self.builder:
            return SafeStorageWriter._write_item(self, sink, file_name, item, planner)
        return super()._write_item(sink, file_name, item, planner)


class GatedWriter(SafeStorageWriter):
    """Background writes wait for ``gate`` (a save stays in flight until the test says); the
    foreground (main-thread) writer does not. ``timeout_s`` is a safety net, never an assertion."""

    def __init__(self, root: Any, gate: threading.Event, timeout_s: float = 120.0) -> None:
        super().__init__(root)
        self.gate, self.timeout_s = gate, timeout_s

    def write_data(self, plan: Any, planner: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert self.gate.wait(self.timeout_s)
        return super().write_data(plan, planner)


class SlowOnRank(SafeStorageWriter):
    """Sleeps before each item on one rank (of every save, or only of the save of step
    ``at_step``): storage held slow on that rank only."""

    def __init__(
        self, root: str, *, slow_rank: int, delay_s: float, at_step: int | None = None
    ) -> None:
        super().__init__(root)
        self.slow_rank = slow_rank
        self.delay_s = delay_s
        self.at_step = at_step

    def _write_item(self, sink: Any, file_name: str, item: Any, planner: Any) -> Any:
        if self._rank == self.slow_rank and (self.at_step is None or self.step == self.at_step):
            time.sleep(self.delay_s)
        return super()._write_item(sink, file_name, item, planner)


class RecordsPlans(SafeStorageWriter):
    """Appends, on the coordinator, how many items each save's global plan holds to the file
    ``record``: a save that reused the cached plan records 0 (wherever the writer runs)."""

    def __init__(self, root: str, *, record: str) -> None:
        super().__init__(root)
        self.record = record

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        with open(self.record, "a", encoding="utf-8") as out:
            out.write(f"{sum(len(plan.items) for plan in plans)}\n")
        result: list[Any] = super().prepare_global_plan(plans)
        return result


class DamagesAfterCommit(SafeStorageWriter):
    """Damages the save of step ``at_step`` once it is committed (wherever the writer runs):
    ``"manifest"`` rewrites a byte of its manifest (the marker no longer matches), ``"shard"``
    flips a byte of rank 0's shard (only a check of every byte sees it)."""

    def __init__(self, root: str, *, at_step: int, part: str, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.at_step = at_step
        self.part = part

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        if self.step != self.at_step:
            return
        folder = Path(self.root) / str(self.checkpoint_id)
        part = self.part == "manifest"
        target = folder / (
            dcp_safe.layout.MANIFEST if part else dcp_safe.layout.shard_file_name(0, 0)
        )
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))


class Planted:
    """Unpickling it creates the directory ``path``: a stand-in for any code an attacker runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))
