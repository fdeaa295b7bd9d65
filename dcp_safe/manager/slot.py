"""The single-flight slot: at most one save in flight and at most one pending, never a queue.

The training thread *freezes* the slot while the ranks vote on a request (:meth:`SaveSlot.frozen`),
so every rank replaces the same pending save or none.

Thread safety: any thread; the state is guarded by the manager's condition.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from dcp_safe.manager.handles import Pending, SaveHandle


class SaveSlot:
    """Who holds the slot (``busy``), who waits behind it (``pending``), and the waits it cost.
    ``cond``: the manager's condition, notified whenever the slot frees up."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.busy: SaveHandle | None = None
        self.pending: Pending | None = None
        self.waiting = 0
        self.waited_s = 0.0
        self._since = 0.0  # time.monotonic() when the save in flight took the slot
        self._frozen = False

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:  # while a request's vote runs: the pending save stays
        with self._cond:
            self._frozen = True
        try:
            yield
        finally:
            with self._cond:
                self._frozen = False
                self._cond.notify_all()

    def pending_step(self) -> int | None:
        with self._cond:
            return None if self.pending is None else self.pending.handle.step

    def take(self, handle: SaveHandle) -> None:
        with self._cond:
            if self.busy is None:
                self._hold(handle)

    def wait_free(self, timeout_s: float | None) -> bool:  # counted in the wait stats
        with self._cond:
            if self.busy is None:
                return True
            started = time.perf_counter()
            self.waiting += 1
            try:
                return self._cond.wait_for(lambda: self.busy is None, timeout_s)
            finally:
                self.waiting -= 1
                self.waited_s += time.perf_counter() - started

    def stalled(self, objective_s: float | None) -> str | None:  # past latency_objective_s
        with self._cond:
            age = None if self.busy is None else time.monotonic() - self._since
        if age is None or objective_s is None or age <= objective_s:
            return None
        return f"the save in flight is {age:.1f} s old, over latency_objective_s={objective_s:g}"

    def _hold(self, handle: SaveHandle) -> None:
        self.busy, self._since = handle, time.monotonic()

    def park(self, pending: Pending) -> tuple[Pending | None, bool]:
        """Make ``pending`` the pending save; the one it replaced, and whether the slot was
        free meanwhile (then ``pending`` holds it now, and the caller must start it)."""
        with self._cond:
            replaced, self.pending = self.pending, pending
            if self.busy is None:
                self.pending = None
                self._hold(pending.handle)
                return replaced, True
            return replaced, False

    def release(self) -> Pending | None:
        """Free the slot, or hand it to the pending save (returned; the caller starts it).

        With a pending save, waits until the slot is not :meth:`frozen`."""
        with self._cond:
            self._cond.wait_for(lambda: self.pending is None or not self._frozen)
            pending, self.pending = self.pending, None
            if pending is not None:
                self._hold(pending.handle)
            else:
                self.busy = None
            self._cond.notify_all()
            return pending

    def drop_pending(self) -> Pending | None:
        with self._cond:
            pending, self.pending = self.pending, None
            return pending

    def idle(self, timeout_s: float | None = 0) -> bool:  # nothing in flight nor pending
        with self._cond:
            return self._cond.wait_for(
                lambda: self.busy is None and self.pending is None, timeout_s
            )

    def drain(self, timeout_s: float) -> SaveHandle | None:
        with self._cond:
            self._cond.wait_for(lambda: self.busy is None, timeout_s)
            return self.busy
