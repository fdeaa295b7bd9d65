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
    CheckpointExistsError,
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


def await_committed(
    backend: Backend,
    name: str,
    *,
    timeout_s: float,
    pause_s: float,
    save_id: str | None = None,
    before: Callable[[], None] = lambda: None,
    between: Callable[[], None] = lambda: None,
) -> Manifest:
    """``name``'s manifest once ``<name>/_COMMITTED`` matches it on ``backend``, polled every
    ``pause_s`` for at most ``timeout_s``. ``before`` runs first on every poll, ``between``
    after each poll that found nothing; either raises to end the wait (a peer's failure).

    Raises:
        CheckpointExistsError: ``save_id`` is given and another save committed ``name``.
        ReplicationTimeoutError: not committed by the deadline; storage errors while polling
            are retried until then (the last one is chained).
    """
    last: Exception | None = None

    def committed() -> Manifest | None:
        nonlocal last
        before()
        try:
            manifest = open_committed(backend, name).manifest
        except (CheckpointNotFoundError, CheckpointCorruptError, OSError) as exc:
            last = exc  # not there yet, or half-visible on an eventually consistent store
            manifest = None
        if manifest is None:
            between()
        elif save_id is not None and manifest.save_id != save_id:
            raise CheckpointExistsError(backend.full_path(name), "another save committed it")
        return manifest

    found = poll(committed, timeout_s, pause_s=pause_s, max_pause_s=pause_s)
    if found is None:
        where = backend.full_path(name)
        raise ReplicationTimeoutError(f"{where} was not committed within {timeout_s} s") from last
    return found


def watch_for_commit(
    backend: Backend, name: str, *, poll_s: float = 0.5, timeout_s: float = DEFAULT_WATCH_TIMEOUT_S
) -> Future[Manifest]:
    """A future for ``name``'s manifest once ``<name>/_COMMITTED`` matches it on ``backend``
    (:func:`await_committed` on a thread of its own)."""
    future: Future[Manifest] = Future()

    def watch() -> None:
        try:
            future.set_result(await_committed(backend, name, timeout_s=timeout_s, pause_s=poll_s))
        except BaseException as exc:  # whatever ends the watch reaches the waiting writer
            future.set_exception(exc)

    threading.Thread(target=watch, name=f"dcp_safe-watch-{name}", daemon=True).start()
    return future
