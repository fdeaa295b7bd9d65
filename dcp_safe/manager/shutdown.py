"""How a manager stops: a close bounded by one deadline, and the drain at interpreter exit."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook first: see _BEFORE_POOLS_STOP)
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from dcp_safe.errors import DrainTimeoutError

log = logging.getLogger("dcp_safe.manager")


def countdown(timeout_s: float | None) -> Callable[[], float | None]:
    """The seconds left of ``timeout_s`` from now, at each call (``None``: no bound)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    return lambda: None if deadline is None else max(0.0, deadline - time.monotonic())


class _Closable(Protocol):
    def close(self, timeout_s: float | None = None) -> None: ...


def run_bounded(steps: list[Callable[[], object]], timeout_s: float | None) -> list[BaseException]:
    """Run ``steps`` in order, each whatever the previous raised; their errors.

    With a timeout they run on a thread of their own, so a step with no bound of its own (a
    prune on a slow file system) cannot hold the caller: a :class:`DrainTimeoutError` comes
    first at ``timeout_s`` and the rest goes on in the background.
    """
    errors: list[BaseException] = []

    def run() -> None:
        for step in steps:
            try:
                step()
            except BaseException as exc:
                errors.append(exc)

    if timeout_s is None:
        run()
        return errors
    closer = threading.Thread(target=run, name="dcp_safe-close", daemon=True)
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        return [
            DrainTimeoutError(
                f"close did not finish within {timeout_s:g} s; what is left goes on in the"
                " background"
            ),
            *errors,
        ]
    return errors


# The at-exit closes still to run, when the main thread ends: before ``concurrent.futures``
# stops its pools from the same ``threading`` exit hooks (run last registered first; by
# ``atexit`` the pools refuse work, and the save in flight would fail). Where that hook is
# missing, the ``atexit`` hook alone runs.
_BEFORE_POOLS_STOP: weakref.WeakSet[Callable[[], None]] = weakref.WeakSet()


def _close_all_before_pools_stop() -> None:
    for close in list(_BEFORE_POOLS_STOP):
        close()


with contextlib.suppress(AttributeError):  # after the pools' own hook (imported above)
    threading._register_atexit(_close_all_before_pools_stop)  # type: ignore[attr-defined]


def close_at_exit(manager: weakref.ref[_Closable], timeout_s: float) -> Callable[[], None]:
    """An ``atexit`` hook that closes ``manager`` if it is still alive (without keeping it so).

    The close runs once, at the first of: the main thread's end (:data:`_BEFORE_POOLS_STOP`)
    or the returned hook. A close that fails is logged as one line, never a traceback.
    """
    done = threading.Lock()

    def close() -> None:
        if not done.acquire(blocking=False):
            return  # closed already
        live = manager()
        if live is None:
            return
        try:
            live.close(timeout_s)
        except BaseException as exc:  # at exit: say what happened, in one line
            log.warning(
                "dcp_safe: draining the CheckpointManager at exit failed: %s: %s",
                type(exc).__name__,
                " ".join(str(exc).split())[:500],
            )

    _BEFORE_POOLS_STOP.add(close)
    return close
