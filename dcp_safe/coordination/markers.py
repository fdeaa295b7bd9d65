"""Coordination through storage: wait, by polling, for what another rank or process leaves there.

Ranks that do not publish learn that a publish happened through storage, not through the
training process group, so a background wait can never deadlock with training collectives; a
save without collectives agrees and gathers the same way (docs/multirank.md, "Saves without
collectives"). Every wait here is bounded by its deadline, the one polling loop is :func:`poll`.
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

T = TypeVar("T")

DEFAULT_WATCH_TIMEOUT_S = 3600.0
# Storage polls start fast (a healthy peer is milliseconds behind) and back off to this.
_MAX_POLL_S = 0.25


def poll(
    check: Callable[[], T | None],
    deadline_s: float,
    *,
    pause_s: float = 0.005,
    max_pause_s: float = _MAX_POLL_S,
) -> T | None:
    """``check()`` until it returns something, at most ``deadline_s``; None at the deadline.

    ``check`` is called at least once, and once more at the deadline; its exceptions propagate
    unchanged (a peer's failure marker ends the wait early). The pauses between calls start at
    ``pause_s`` and double up to ``max_pause_s``.
    """
    deadline = time.monotonic() + deadline_s
    pause = pause_s
    while True:
        found = check()
        if found is not None:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, max_pause_s)


def watch_for_commit(
    backend: Backend, name: str, *, poll_s: float = 0.5, timeout_s: float = DEFAULT_WATCH_TIMEOUT_S
) -> Future[Manifest]:
    """A future for ``name``'s manifest once ``<name>/_COMMITTED`` matches it on ``backend``.

    Fails with ``ReplicationTimeoutError`` after ``timeout_s``; storage errors while polling are
    retried until then (the last one is chained).
    """
    future: Future[Manifest] = Future()
    last: BaseException | None = None

    def committed() -> Manifest | None:
        nonlocal last
        try:
            return open_committed(backend, name).manifest
        except (CheckpointNotFoundError, CheckpointCorruptError, OSError) as exc:
            last = exc  # not there yet, or half-visible on an eventually consistent store
            return None

    def watch() -> None:
        found = poll(committed, timeout_s, pause_s=poll_s, max_pause_s=poll_s)
        if found is not None:
            future.set_result(found)
            return
        error = ReplicationTimeoutError(
            f"{backend.full_path(name)} was not committed within {timeout_s} s"
        )
        error.__cause__ = last
        future.set_exception(error)

    threading.Thread(target=watch, name=f"dcp_safe-watch-{name}", daemon=True).start()
    return future
