"""Helpers for the crash-consistency and corruption tests.

* states whose every byte is known (``make_values``), a load target for them, and a bit-exact
  comparison;
* ``install_kill_switch``: in a forked child only, count every storage operation the POSIX backend
  makes (file creates and writes, fsync, mkdir, rename, unlink) and SIGKILL the process just before
  operation N. Large writes are split in two operations, so a kill can also tear a write;
* ``save_loop``: saves until its parent kills it, for a process killed at a random moment;
* ``start_fork`` / ``wait_fork`` / ``fork_and_wait``: run a function in a forked child that
  always ends with ``os._exit`` (never pytest's teardown), and wait for it with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.backends import local_backend
from dcp_safe.staging import stager as stager_module

# A child that finished its work exits with this; one killed by the switch shows SIGKILL.
CHILD_DONE = 0
CHILD_FAILED = 3
# A child the switch ended with os._exit exits with this.
CHILD_EXITED = 97
KILL_MODES = ("sigkill", "exit")
# Writes longer than this count as two operations (first half, second half): a torn write.
_SPLIT_BYTES = 512


def make_values(seed: int, *, scale: int = 1) -> dict[str, Any]:
    """Mixed dtypes (f32, bf16, i64, f16) and a nested Python object, all derived from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(32 * scale, 16, generator=gen),
        "bf16": torch.randn(64 * scale, generator=gen).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (20,), generator=gen),
        "f16": torch.randn(4, 4, generator=gen).to(torch.float16),
        "extra": {
            "step": seed,
            "history": [0.5 * seed, {"lr": 1.0 / (seed + 1)}],
            "tag": f"s{seed}",
        },
    }


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target with the structure of ``state``: tensors zeroed, objects scrambled."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = {"step": -1, "history": [-1.0, {"lr": -1.0}], "tag": "blank"}
    return out


def is_bit_exact(actual: dict[str, Any], expected: dict[str, Any]) -> bool:
    """True when ``actual`` holds exactly the bytes and objects of ``expected``."""
    try:
        assert_bit_exact(actual, expected)
    except AssertionError:
        return False
    return True


def assert_bit_exact(actual: dict[str, Any], expected: dict[str, Any], label: str = "") -> None:
    """Every tensor has the same dtype, shape and bytes; every object compares equal."""
    assert actual.keys() == expected.keys(), label
    for key, value in expected.items():
        got = actual[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape, f"{label}: {key}"
            assert torch.equal(_raw_bytes(got), _raw_bytes(value)), f"{label}: {key} bytes differ"
        else:
            assert got == value, f"{label}: {key}"


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def save_values(
    root: str | os.PathLike[str], name: str, seed: int, *, scale: int = 1, **writer_options: Any
) -> dict[str, Any]:
    """Commit ``make_values(seed, scale=scale)`` as ``name``, written with
    ``WriterOptions(**writer_options)``; returns the values."""
    values = make_values(seed, scale=scale)
    dcp_safe.save(
        values,
        checkpoint_id=name,
        storage_writer=SafeStorageWriter(root, options=WriterOptions(**writer_options)),
        no_dist=True,
    )
    return values


def save_loop(root: str, scale: int, conn: Connection) -> None:
    """Once ``conn`` says go, commit ``step_2``, ``step_3``, ... (writer options varying by step)
    into ``root`` until killed: a process its parent kills at a random moment."""
    conn.send("ready")
    conn.recv()
    conn.send("saving")
    step = 2
    while True:
        options = {"thread_count": 1 + step % 2, "compression": "zstd" if step % 3 else "none"}
        save_values(root, f"step_{step}", step, scale=scale, **options)
        step += 1


def load_values(root: str | os.PathLike[str], name: str, like: dict[str, Any]) -> dict[str, Any]:
    """Load checkpoint ``name`` (or ``"latest"``) into a blank copy of ``like``."""
    target = blank_like(like)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root), no_dist=True)
    return target


# --------------------------------------------------------------------------- kill switch


class KillSwitch:
    """Counts storage operations; kills the process just before operation ``kill_at``.

    ``how``: ``"sigkill"`` (the kernel ends the process: no handler, no ``finally``) or
    ``"exit"`` (``os._exit``: the process ends itself at once, without unwinding, flushing
    Python's buffers or running ``atexit``, as a fatal error path or ``os._exit`` in user code
    does). With ``record``, it also keeps a label per operation
    (``"fsync .step_2.partial-…/.metadata"``) so a sweep can say what each kill point interrupts.
    """

    def __init__(self, kill_at: int, *, record: bool = False, how: str = "sigkill") -> None:
        if how not in KILL_MODES:
            raise ValueError(f"how must be one of {KILL_MODES}, got {how!r}")
        self.kill_at = kill_at
        self.how = how
        self.count = 0
        self.labels: list[str] | None = [] if record else None
        self._lock = threading.Lock()

    def tick(self, kind: str, target: object) -> None:
        with self._lock:
            self.count += 1
            if self.count == self.kill_at:
                if self.how == "exit":
                    os._exit(CHILD_EXITED)
                os.kill(os.getpid(), signal.SIGKILL)
            if self.labels is not None:
                self.labels.append(f"{kind} {_describe(target)}")


def _describe(target: object) -> str:
    if isinstance(target, int):  # a file descriptor
        with contextlib.suppress(OSError):
            return os.path.basename(os.readlink(f"/proc/self/fd/{target}"))
    return os.path.basename(os.fsdecode(target)) if isinstance(target, str | bytes) else "?"


class _CountingFile:
    """The file ``open_write`` yields, with each write counted (and large ones torn in two)."""

    def __init__(self, target: Any, rel: str, switch: KillSwitch) -> None:
        self._target = target
        self._rel = rel
        self._switch = switch

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes > _SPLIT_BYTES:
            half = view.nbytes // 2
            self._switch.tick("write", self._rel)
            self._target.write(view[:half])
            self._switch.tick("write-rest", self._rel)
            self._target.write(view[half:])
        else:
            self._switch.tick("write", self._rel)
            self._target.write(view)
        return view.nbytes

    def tell(self) -> int:
        return int(self._target.tell())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def install_kill_switch(kill_at: int, *, record: bool = False, how: str = "sigkill") -> KillSwitch:
    """Count the storage operations of this process; kill it just before ``kill_at``.

    Counted: ``LocalBackend.open_write`` and each write into the file it yields, the ``os``
    calls the backend makes (open, write, fsync, mkdir, rename, unlink, rmdir, renameat2), and
    each tensor the :class:`~dcp_safe.BudgetedStager` copies (so a kill can land mid-staging).
    A write longer than 512 bytes counts twice (each half), so a kill can tear it. Only ever
    call this in a forked child: the patches are never undone.
    """
    switch = KillSwitch(kill_at, record=record, how=how)

    def counted(kind: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(target: Any, *args: Any, **kwargs: Any) -> Any:
            switch.tick(kind, target)
            return func(target, *args, **kwargs)

        return wrapper

    real_write = os.write

    def torn_write(fd: int, data: Any) -> int:
        view = memoryview(data).cast("B")
        switch.tick("os.write", fd)
        if view.nbytes > _SPLIT_BYTES:
            return real_write(fd, view[: view.nbytes // 2])  # the caller loops for the rest
        return real_write(fd, view)

    for name in ("open", "fsync", "mkdir", "rename", "unlink", "rmdir"):
        setattr(os, name, counted(name, getattr(os, name)))
    os.write = torn_write  # type: ignore[assignment]
    local_backend._renameat2 = counted("renameat2", local_backend._renameat2)  # type: ignore[assignment]

    real_open_write = local_backend.LocalBackend.open_write

    @contextlib.contextmanager
    def open_write(self: Any, rel: str) -> Iterator[Any]:
        switch.tick("create", rel)
        with real_open_write(self, rel) as f:
            yield _CountingFile(f, os.path.basename(rel), switch)

    local_backend.LocalBackend.open_write = open_write  # type: ignore[assignment,method-assign]
    _count_staging(switch)
    return switch


def _count_staging(switch: KillSwitch) -> None:
    real_copy = stager_module.BudgetedStager._copy

    def copy(self: Any, gen: Any, state_dict: Any, layout: Any, *args: Any) -> None:
        # One tick per tensor the walk found, before the staging thread copies them (the copy
        # itself is a few _foreach_copy_ calls): a kill lands between the request and the copy.
        for _ in layout.candidates:
            switch.tick("stage", "tensor")  # kills or returns, never raises
        real_copy(self, gen, state_dict, layout, *args)

    stager_module.BudgetedStager._copy = copy  # type: ignore[assignment,method-assign]


# --------------------------------------------------------------------------- fork


def start_fork(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child and return its pid; the child always leaves through
    ``os._exit`` (never pytest's teardown): 0 when ``work`` returned, 3 when it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = CHILD_FAILED
        try:
            work()
            code = CHILD_DONE
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def wait_fork(pid: int, *, deadline_s: float = 120.0) -> int:
    """Wait for a forked child; return its exit code, or ``-signal`` if a signal ended it.

    A child still running at the deadline is killed and the call fails: the deadline is far
    beyond anything a healthy child needs, so reaching it means a hang, not a slow machine.
    """
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"forked child {pid} still running after {deadline_s} s")
        time.sleep(0.001)


def fork_and_wait(work: Callable[[], None], *, deadline_s: float = 120.0) -> int:
    """``start_fork`` then ``wait_fork``."""
    return wait_fork(start_fork(work), deadline_s=deadline_s)


# --------------------------------------------------------------------------- figures

# Set by scripts/reliability_report.py: each sweep appends one JSON line of figures here.
FIGURES_ENV = "DCP_SAFE_FIGURES"


def record_figures(kind: str, **figures: Any) -> None:
    """Append ``{"kind": kind, **figures}`` as a JSON line to ``$DCP_SAFE_FIGURES``, if set."""
    import json

    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": kind, **figures}) + "\n")
