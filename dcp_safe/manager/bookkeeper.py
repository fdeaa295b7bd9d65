"""The coordinator's history appends, off the decision path: in order, on their own thread.

Why, and what a failed append does: docs/multirank.md, "Bookkeeping never decides".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from dcp_safe.checkpoints.history import History

__all__ = ["Bookkeeper"]

log = logging.getLogger("dcp_safe.manager")


class Bookkeeper:
    """Queued appends to a root's history file.

    Args:
        enabled: append at all (in a multi-rank job, only the coordinator does).
        failed: called with each append's error (the manager counts them).
    """

    def __init__(
        self, history: History, *, enabled: bool, failed: Callable[[BaseException], None]
    ) -> None:
        self.history = history
        self.enabled = enabled
        self._failed = failed
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp_safe-history")

    def append(self, event: str, step: int | None, name: str | None, **fields: Any) -> None:
        """Queue one event (as :meth:`History.append` takes it); never raises for storage."""
        if not self.enabled:
            return
        try:
            self._pool.submit(self._write, event, step, name, fields)
        except RuntimeError:  # closed (interpreter exit): write it here, or give up quietly
            self._write(event, step, name, fields)

    def flush(self, timeout_s: float | None) -> bool:
        """Wait for every event queued so far to be written (or to fail); whether they were
        within ``timeout_s``. A commit, ``history()``, ``wait()`` and ``close()`` flush first."""
        if not self.enabled:
            return True
        try:
            self._pool.submit(lambda: None).result(timeout=timeout_s)
        except FutureTimeout:
            log.warning("history appends still pending after %s s", timeout_s)
            return False
        except RuntimeError:  # closed: nothing more is queued
            return True
        return True

    def read(self) -> list[dict[str, Any]]:
        """The history file's events (after the appends queued so far, bounded)."""
        self.flush(_READ_FLUSH_S)
        return self.history.read()

    def validated_names(self) -> set[str]:
        return self.history.validated_names()

    def close(self, timeout_s: float | None) -> None:
        """Write what is queued (within ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        self._pool.shutdown(wait=False)

    def _write(self, event: str, step: int | None, name: str | None, fields: Any) -> None:
        try:
            self.history.append(event, step, name, **fields)
        except Exception as exc:
            # repr: the error may quote a path or text read from storage
            log.warning(
                "could not record the %r event of %r in the history: %r",
                event,
                name,
                f"{type(exc).__name__}: {exc}"[:300],
            )
            self._failed(exc)


# How long a read waits for queued appends before it reads what is there.
_READ_FLUSH_S = 30.0
