"""One outcome per save on every rank: the coordinator's verdict, passed through the store.

Each rank's own check of a new checkpoint can disagree (a second-long outage fails rank 0's read
and not rank 1's), so the coordinator checks and posts its verdict and the others adopt it; a
rank's own failure is not a verdict, as the coordinator checked every rank's part before it
published. The store, not a gloo group: a wait that times out there breaks nothing. Keys count
saves per name, so they match whatever order a background and a foreground follow-up run in.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from dcp_safe.errors import CommitError
from dcp_safe.manager.agreement import Agreement
from dcp_safe.torch_compat import default_store

__all__ = ["Verdicts"]

_OK = "ok"
_FAILED = "failed:"
_MAX_REASON = 2000


class Verdicts:
    """Post (coordinator) and await (everyone else) the outcome of each save.

    Args:
        store: the default group's store.
        token: the manager's agreed key prefix.
    """

    def __init__(self, store: Any, token: str, *, coordinator: bool, timeout_s: float) -> None:
        self._store = store
        self._prefix = f"dcp_safe/manager/{token}/verdict"
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    @classmethod
    def for_job(cls, agreement: Agreement, timeout_s: float) -> Verdicts | None:
        """A manager's verdicts (``None`` in a single process: its own checks decide)."""
        if not agreement.distributed:
            return None
        return cls(
            default_store(), agreement.token, coordinator=agreement.coordinator, timeout_s=timeout_s
        )

    def key_for(self, name: str) -> str:
        """The key of the next verdict on ``name`` (one per save of that name)."""
        with self._lock:
            self._counts[name] = count = self._counts.get(name, 0) + 1
        return f"{self._prefix}/{name}/{count}"

    def post(self, key: str, failure: BaseException | None) -> None:
        """The coordinator's verdict: committed (``failure`` is ``None``) or why not."""
        text = _OK if failure is None else _FAILED + f"{type(failure).__name__}: {failure}"
        self._store.set(key, text[:_MAX_REASON])

    def await_verdict(self, key: str) -> CommitError | None:
        """The coordinator's verdict on this rank: ``None`` if committed, else the error (also
        a ``CommitError`` naming rank 0 when none came within ``timeout_s``)."""
        try:
            self._store.wait([key], timedelta(seconds=self.timeout_s))
        except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
            return CommitError(
                "no verdict on the save from the coordinator",
                {0: f"did not report whether the save committed within {self.timeout_s:g} s"},
            )
        text = self._store.get(key).decode("utf-8", errors="replace")
        if text == _OK:
            return None
        return CommitError("the coordinator found the save not committed", {0: text[7:]})
