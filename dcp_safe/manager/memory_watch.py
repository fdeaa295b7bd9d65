"""The fallback's memory signal: sampled every second, reported as the lowest since last asked.

Sampled only at save requests it would see the node between saves, when staging holds least,
and miss the dips a save itself causes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dcp_safe.host_memory import available_bytes_now
from dcp_safe.periodic import Periodic

__all__ = ["MemoryWatch"]

log = logging.getLogger(__name__)


class MemoryWatch:
    """A background sampler of available memory (a daemon thread)."""

    def __init__(
        self, sample: Callable[[], int] = available_bytes_now, interval_s: float = 1.0
    ) -> None:
        self._sample = sample
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._lowest: int | None = None
        self._periodic = Periodic(self._tick, interval_s, name="dcp_safe-fallback-watch").start()

    def lowest(self) -> int | None:
        """The lowest reading since the last call (``None``: the host does not say)."""
        with self._lock:
            lowest, self._lowest = self._lowest, None
        now = self._read()
        if lowest is None:
            return now
        return lowest if now is None else min(lowest, now)

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._periodic.stop(timeout_s=5)

    def _tick(self) -> None:
        reading = self._read()
        if reading is None:
            return
        with self._lock:
            self._lowest = reading if self._lowest is None else min(self._lowest, reading)

    def _read(self) -> int | None:
        try:
            return int(self._sample())
        except (OSError, ValueError) as exc:  # a host that stops saying is not an error
            log.debug("dcp_safe: reading available memory failed: %s", exc)
            return None
