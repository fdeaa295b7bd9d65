"""``Periodic``: one daemon thread that calls a function every interval until stopped.

Every background sampler of the package is this loop around its own reading. The interval is
read again before every wait, so a sampler can change pace, and :meth:`Periodic.wake` cuts the
current wait short, so a change of pace takes effect at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    """Calls ``tick`` on a daemon thread every ``interval_s`` seconds until :meth:`stop`.

    The first call comes one interval after :meth:`start`; an exception from ``tick`` ends the
    thread (callers that must keep sampling catch their own).

    ``interval_s`` may be a function, read before every wait.
    """

    def __init__(
        self, tick: Callable[[], object], interval_s: float | Callable[[], float], *, name: str
    ) -> None:
        self._tick = tick
        self._interval = interval_s if callable(interval_s) else (lambda: interval_s)
        self._wake = threading.Event()  # set: the current wait ends now
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def wake(self) -> None:
        """End the current wait now: the next call comes at once."""
        self._wake.set()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the thread and wait up to ``timeout_s`` (``None``: as long as it takes) for a
        ``tick`` in progress, unless called from ``tick``; idempotent."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval())
            if self._stopping:
                return
            self._wake.clear()  # a wake from now on (during the tick) ends the next wait
            self._tick()
