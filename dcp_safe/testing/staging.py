"""A test hook for the stager: hold its staging thread so a test can act "during the copy".

Races between a save's copy and the training loop's in-place updates are what the mutation
guard exists for, and a test that waits for a real race to happen proves little when it does
not. :func:`hold_staging` makes the race deterministic: while it is held, every ``stage()``
call is admitted and returns its Future, but no copy starts, so an update made then is
certainly "between the request and the end of the copy".

It relies on one documented property of :class:`~dcp_safe.staging.BudgetedStager`: copies run
on one staging thread, in the order they were requested.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from dcp_safe.staging import BudgetedStager

__all__ = ["hold_staging"]


@contextmanager
def hold_staging(stager: BudgetedStager, timeout_s: float = 60.0) -> Iterator[threading.Event]:
    """Hold ``stager``'s staging thread until the block ends (or the Event it yields is set).

    Args:
        stager: the stager to hold; it must not be closed.
        timeout_s: the longest the thread is held if the block never ends (a failing test
            must not hang the stager).

    Yields:
        The release: set it to let copies run before the block ends.
    """
    release = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(timeout_s)

    stager.run_on_staging_thread(hold)
    holding.wait(timeout_s)
    try:
        yield release
    finally:
        release.set()
