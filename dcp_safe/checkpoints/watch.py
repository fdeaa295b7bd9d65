"""Wait for something to appear on storage (a commit marker, every rank's manifest), by polling.

Ranks that do not publish learn that a publish happened through storage, not through the
training process group, so a background wait can never deadlock with training collectives.
Every wait here is bounded: it ends with :class:`ReplicationTimeoutError` at its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ReplicationTimeoutError,
)
from dcp_safe.manifest.schema import Manifest

__all__ = ["poll_until", "watch_for_commit"]

T = TypeVar("T")

DEFAULT_WATCH_TIMEOUT_S = 3600.0


def watch_for_commit(
    backend: Backend, name: str, *, poll_s: float = 0.5, timeout_s: float = DEFAULT_WATCH_TIMEOUT_S
) -> Future[Manifest]:
    """A future for ``name``'s manifest once ``<name>/_COMMITTED`` matches it on ``backend``.

    Fails with ``ReplicationTimeoutError`` after ``timeout_s``; storage errors while polling are
    retried until then (the last one is chained).
    """
    future: Future[Manifest] = Future()

    def poll() -> None:
        deadline = time.monotonic() + timeout_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                future.set_result(open_committed(backend, name).manifest)
                return
            except (CheckpointNotFoundError, CheckpointCorruptError, OSError) as exc:
                last = exc  # not there yet, or half-visible on an eventually consistent store
            time.sleep(poll_s)
        error = ReplicationTimeoutError(
            f"{backend.full_path(name)} was not committed within {timeout_s} s"
        )
        error.__cause__ = last
        future.set_exception(error)

    threading.Thread(target=poll, name=f"dcp_safe-watch-{name}", daemon=True).start()
    return future


def poll_until(
    check: Callable[[], T | None], *, timeout_s: float, poll_s: float, waiting_for: str
) -> T:
    """Call ``check`` every ``poll_s`` seconds until it returns something other than None.

    ``check`` raises to end the wait early (a peer reported a failure); its exceptions
    propagate unchanged. It is called at least once, and once more at the deadline.

    Args:
        timeout_s: the deadline, from now.
        waiting_for: what is awaited, for the timeout's message.

    Raises:
        ReplicationTimeoutError: ``check`` still returned None at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found is not None:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ReplicationTimeoutError(f"gave up after {timeout_s} s waiting for {waiting_for}")
        time.sleep(min(poll_s, remaining))
