"""Counting what a test says must (not) happen in this process."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psutil
import pytest

from dcp_safe.manifest.schema import Manifest


def manifest_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``Manifest.from_json`` parses in this process from now on (not in workers)."""
    seen: list[str] = []
    parse = Manifest.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, data: bytes, path: str) -> Any:
        seen.append(path)
        return parse(cls, data, path)

    monkeypatch.setattr(Manifest, "from_json", classmethod(counting))
    return seen


def checkpoint_workers() -> list[int]:
    """The pids of this process's checkpoint workers (``executor="process"``), not of the
    other children a test session may have (DCP's own checkpoint daemon, for one)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "dcp_safe/worker/boot.py" in " ".join(child.cmdline()):
                found.append(child.pid)
    return found


def ready_worker(manager: Any, timeout_s: float = 120.0) -> int:
    """Start ``manager``'s checkpoint worker and wait until it is ready (every rank's, with
    several: call it on each); the saves requested after it run there, not on a thread. Its
    pid."""
    worker = manager._runner.worker
    assert worker is not None, "the manager has no checkpoint worker (executor='thread')"
    worker.start()
    deadline = time.monotonic() + timeout_s
    while not worker.ready:
        assert time.monotonic() < deadline, f"the checkpoint worker not ready in {timeout_s} s"
        time.sleep(0.01)
    assert worker.pid is not None
    return int(worker.pid)
