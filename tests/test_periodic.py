"""dcp_safe.periodic.Periodic: the one background loop every sampler runs in."""

from __future__ import annotations

import threading
import time

from dcp_safe.periodic import Periodic


def test_it_calls_tick_every_interval_until_stopped() -> None:
    calls: list[float] = []
    periodic = Periodic(lambda: calls.append(time.monotonic()), 0.01, name="t").start()
    time.sleep(0.2)
    periodic.stop()
    seen = len(calls)
    time.sleep(0.05)
    assert seen >= 3
    assert len(calls) == seen  # nothing after stop


def test_the_interval_is_read_before_every_wait_and_wake_cuts_the_wait_short() -> None:
    ticked = threading.Event()
    periodic = Periodic(ticked.set, lambda: 60.0, name="t").start()
    assert not ticked.wait(0.1)
    periodic.wake()
    assert ticked.wait(2)
    periodic.stop()


def test_stop_is_idempotent_and_may_be_called_from_tick() -> None:
    holder: list[Periodic] = []
    done = threading.Event()

    def tick() -> None:
        holder[0].stop()
        done.set()

    holder.append(Periodic(tick, 0.001, name="t").start())
    assert done.wait(2)
    holder[0].stop()
    holder[0].stop(timeout_s=1)
