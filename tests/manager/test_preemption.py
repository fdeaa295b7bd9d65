"""Preemption: on a signal the manager drains, saves the live state once more, and chains.

The SIGTERM test runs a real training script in a subprocess; bounds there are generous safety
nets, never timing assertions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from support import blank_like, make_state
from support.faults import GatedWriter

import dcp_safe
from dcp_safe import Bounds, Runtime
from dcp_safe.errors import ConfigError
from dcp_safe.manager import CheckpointManager
from dcp_safe.staging import MemoryBudget

pytestmark = pytest.mark.subprocess

_EXIT_TIMEOUT_S = 120  # a safety net against a hang, never an assertion

_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    import torch
    from dcp_safe.manager import Bounds, CheckpointManager
    from dcp_safe.staging import MemoryBudget

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "step": 0}  # live tensors: updated in place
    budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0)
    manager = CheckpointManager(
        sys.argv[1], when_busy="skip", keep_last=3, bounds=Bounds(budget=budget)
    )
    manager.install_preemption_handler(signal.SIGTERM, budget_s=30)
    with manager:
        for step in range(1, 100_000):
            # The signal lands between steps, never inside an update (dcp_safe.manager.preemption).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] = step
            manager.maybe_save(step, state)
            print(f"step {step}", flush=True)
            if step == 5:
                print("ready", flush=True)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            time.sleep(0.02)
    print("loop ended without a signal", flush=True)
    """
)


def test_sigterm_saves_the_last_step_and_exits_143(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "ready":
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=_EXIT_TIMEOUT_S)
    lines += out.splitlines()
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = max(int(x.split()[1]) for x in lines if x.startswith("step "))
    name = f"step_{last:09d}"
    assert dcp_safe.list_checkpoints(root)[-1].name == name
    assert dcp_safe.verify_checkpoint(root, name) is not None
    budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0)
    manager = CheckpointManager(root, bounds=Bounds(budget=budget))
    with manager:
        [preempted] = [e for e in manager.history() if e["event"] == "preempted"]
        assert preempted["step"] == last and "SIGTERM" in preempted["reason"]


def test_a_python_handler_is_chained_after_abandoning_and_saving_the_live_state(
    tmp_path: Path,
) -> None:
    calls: list[int] = []
    gate = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0)
        writer = GatedWriter(tmp_path, gate)
        manager = CheckpointManager(
            tmp_path,
            keep_last=5,
            when_busy="skip",
            bounds=Bounds(budget=budget),
            runtime=Runtime(writer=writer),
        )
        with manager:
            handler = manager.install_preemption_handler(signal.SIGUSR1, budget_s=0.2)
            state = make_state(1)
            assert manager.save(1, state) is not None  # in flight until the gate opens
            state["extra"]["epoch"] = 2  # the live state changes after the request
            assert manager.save(2, state) is None  # skipped: 1 is in flight
            try:
                os.kill(os.getpid(), signal.SIGUSR1)  # handled here, on the main thread
            finally:
                gate.set()  # the abandoned save may complete now; the manager stays usable
            assert calls == [signal.SIGUSR1]
            assert handler.outcome is not None
            assert "abandoned" in handler.outcome and "step 2 committed" in handler.outcome
            names = [i.name for i in dcp_safe.list_checkpoints(tmp_path)]
            assert names[-1] == "step_000000002"  # step 1 may commit too, now the gate is open
            restored = blank_like(state)
            manager.restore(restored, step=2)
            assert restored["extra"]["epoch"] == 2
            [event] = [e for e in manager.history() if e["event"] == "preempted"]
            assert event["step"] == 2 and "SIGUSR1" in event["reason"]
            manager.wait(_EXIT_TIMEOUT_S)
        assert signal.getsignal(signal.SIGUSR1) is not handler._on_signal  # close uninstalled
    finally:
        gate.set()
        signal.signal(signal.SIGUSR1, previous)


def test_install_refuses_a_second_handler_and_a_bad_budget(tmp_path: Path) -> None:
    budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0)
    previous = signal.getsignal(signal.SIGUSR2)
    with CheckpointManager(tmp_path, bounds=Bounds(budget=budget)) as manager:
        with pytest.raises(ConfigError, match="budget_s"):
            manager.install_preemption_handler(signal.SIGUSR2, budget_s=0)
        manager.install_preemption_handler(signal.SIGUSR2, budget_s=1)
        with pytest.raises(ConfigError, match="installed already"):
            manager.install_preemption_handler(signal.SIGUSR2)
    assert signal.getsignal(signal.SIGUSR2) == previous


def test_a_signal_inside_a_manager_call_is_handled_on_its_way_out(tmp_path: Path) -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    handler_ref: list[Any] = []

    def sampler() -> int:  # runs inside save(), on the main thread
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [] and handler_ref[0].outcome is None  # noted, not handled yet
        return 1 << 30

    try:
        budget = MemoryBudget(usable_bytes=1 << 30, reserve_bytes=0)
        with CheckpointManager(
            tmp_path, bounds=Bounds(budget=budget), runtime=Runtime(memory_sampler=sampler)
        ) as manager:
            handler_ref.append(manager.install_preemption_handler(signal.SIGUSR1, budget_s=60))
            assert manager.save(1, make_state(1)) is not None
            assert calls == [signal.SIGUSR1]
            assert "step 1 was committed already" in handler_ref[0].outcome
            events = [e["event"] for e in manager.history()]
            assert events == ["requested", "committed", "preempted"]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_ctrl_c_during_an_unbounded_close_does_not_abandon_the_drain() -> None:
    # close() without a timeout runs its steps on the caller's thread: a Ctrl-C lands in the
    # step running then, and the steps after it (the rest of the drain) still run; on a thread
    # of their own, the interrupt would return from close() with the drain cut short.
    from dcp_safe.manager.preemption import run_bounded

    ran: list[str] = []

    def interrupted() -> None:
        ran.append("first")
        os.kill(os.getpid(), signal.SIGINT)
        threading.Event().wait(5)  # the signal's KeyboardInterrupt ends this wait

    # Python's own Ctrl-C handler, whatever an earlier test of the session left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        errors = run_bounded([interrupted, lambda: ran.append("second")], None)
    except KeyboardInterrupt:
        pytest.fail(f"the Ctrl-C escaped the close, its drain cut short after {ran}")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ran == ["first", "second"]
    assert [type(e) for e in errors] == [KeyboardInterrupt]
