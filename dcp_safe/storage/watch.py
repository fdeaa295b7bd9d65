"""Wait for a checkpoint to be committed on a root, by polling its marker.

Ranks that do not publish learn that a publish happened through storage, not through the
training process group, so a background wait can never deadlock with training collectives.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.storage.backend import Backend
from dcp_safe.storage.committed import open_committed
from dcp_safe.storage.replicate import ReplicationTimeoutError

__all__ = ["watch_for_commit"]

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
