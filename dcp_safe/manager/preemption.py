"""How a manager stops: a close bounded by one deadline, the drain at interpreter exit, and,
opt-in, a signal handler that saves once more when the job is told to stop.

The sequence (drain half the budget, an agreed final synchronous save of the live state, the
``preempted`` event, then the previous handler) and its limits: docs/runbook.md, "Preemption".
A signal that arrives while the main thread is inside a manager call is handled when the call
returns, so the handler never re-enters the manager.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook first: see _BEFORE_POOLS_STOP)
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from dcp_safe.coordination.agreement import Agreement, Vote, require_same_call
from dcp_safe.errors import ConfigError, DcpSafeError, DrainTimeoutError, _per_rank
from dcp_safe.manager.handles import SaveHandle

if TYPE_CHECKING:
    from dcp_safe.manager.manager import CheckpointManager

log = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionHandler:
    """The signal handler; see the module docstring (``budget_s``: seconds from the signal to
    the end of the drain; ``ConfigError`` unless positive)."""

    def __init__(self, manager: CheckpointManager, signum: int, budget_s: float) -> None:
        if not budget_s > 0:
            raise ConfigError(f"budget_s must be > 0, got {budget_s!r}")
        self.manager = manager
        self.signum = signal.Signals(signum)
        self.budget_s = float(budget_s)
        self.outcome: str | None = None
        self._previous: _Handler = None
        self._installed = False
        self._depth = 0
        self._deferred: tuple[int, FrameType | None] | None = None
        self._handling = False

    def install(self) -> None:  # keeping the previous handler
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("install_preemption_handler() must be called on the main thread")
        self._previous = signal.signal(self.signum, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:  # on the main thread; elsewhere, left installed
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(self.signum) == self._on_signal:
            signal.signal(self.signum, self._previous)
        self._installed = False

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:  # a signal inside a manager call: handled on the way out
        if threading.current_thread() is not threading.main_thread():
            yield  # signals are handled on the main thread only
            return
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and (deferred := self._deferred) is not None:
                self._deferred = None
                self._handle(*deferred)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._depth > 0:
            self._deferred = (signum, frame)
            return
        self._handle(signum, frame)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._handling:  # a second signal while saving: the first one's run goes on
            return
        self._handling = True
        deadline = time.monotonic() + self.budget_s
        try:
            self.outcome = self.manager.preempt_save(
                f"{signal.Signals(signum).name} (budget {self.budget_s:g} s)", deadline
            )
        except BaseException as exc:  # never lose the chained behaviour over a failed save
            log.error("dcp_safe: preemption save failed: %s", exc)
        finally:
            self._handling = False
        previous = self._previous  # chained to
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        status = 128 + signum
        if not self.manager.in_flight():
            try:
                self.manager.close(max(0.0, deadline - time.monotonic()))
            except BaseException as exc:
                log.error("dcp_safe: close after preemption failed: %s", exc)
            raise SystemExit(status)
        log.warning("dcp_safe: exiting with a save still in flight (abandoned)")
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def agreed_plan(
    agreement: Agreement,
    handle: SaveHandle | None,
    busy: SaveHandle | None,
    deadline: float,
    *,
    committed: bool,
) -> str | None:
    """Every rank's reason against a final save of ``handle`` (``busy``: the save in flight it
    gave up on), merged: ``None`` only if no rank sees no point, or no time, in it.

    Under ``torchrun`` the final save is a collective, so it happens on every rank or on none.
    """
    step = -1 if handle is None else handle.step
    why_not = None
    if handle is None:
        why_not = "nothing was ever saved"
    elif committed:
        why_not = f"step {step} was committed already"
    elif busy is not None and busy.name == handle.name:
        why_not = f"step {step} is that save, so no final save"
    elif time.monotonic() >= deadline:
        why_not = f"no time left for a final save of step {step}"
    try:
        votes = agreement.gather(Vote("preempt", step, detail=why_not))
        require_same_call(votes)
    except DcpSafeError as exc:
        return f"final save abandoned on every rank: {exc}"
    objections = {r: v.detail for r, v in enumerate(votes) if v.detail is not None}
    if not objections:
        return None
    if len(objections) == len(votes) and len(set(objections.values())) == 1:
        return str(objections[0])  # e.g. committed already, everywhere
    return f"final save abandoned on every rank ({_per_rank(objections, '; ')})"


def countdown(timeout_s: float | None) -> Callable[[], float | None]:  # None: no bound
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    return lambda: None if deadline is None else max(0.0, deadline - time.monotonic())


def run_bounded(steps: list[Callable[[], object]], timeout_s: float | None) -> list[BaseException]:
    """Run ``steps`` in order, each whatever the previous raised; their errors.

    With a timeout they run on a thread of their own, so a step with no bound of its own (a
    prune on a slow file system) cannot hold the caller: a :class:`DrainTimeoutError` comes
    first at ``timeout_s`` and the rest goes on in the background. Without one they run on the
    caller's thread: a Ctrl-C then ends the step it lands in, not the drain.
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


def close_at_exit(manager: weakref.ref[CheckpointManager], timeout_s: float) -> Callable[[], None]:
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
