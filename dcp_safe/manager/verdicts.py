"""One outcome per save on every rank: the coordinator's verdict, passed through the store.

After a save's upload each rank follows its commit up on its own thread: waits for the remote
commit (node-local saves), checks the new checkpoint, then records it committed or failed. Done
independently, those checks can disagree: a storage outage that lasts a second fails rank 0's
read of the manifest and not rank 1's, and the ranks then hold different outcomes for the same
save (committed on one, failed on another) with the checkpoint itself committed on storage, or
not. So the coordinator decides, as it decides everything about shared storage: it checks the
checkpoint (marker and manifest, or every byte with ``validate="deep"``; the signature with a
key) and posts its verdict; every other rank adopts it. A rank's own failure is not a verdict:
the coordinator checked every rank's part before it published, so a committed checkpoint is
committed for every rank.

Verdicts live in the default group's key-value store, where a wait that times out breaks
nothing (a gloo collective would break its group), keyed by the manager's agreed token, the
checkpoint's name and how many times this manager saved that name (the same on every rank,
whatever order the follow-ups of a background and a foreground save run in). A rank that gets no
verdict within its bound (``wait_timeout_s``: the coordinator is gone, or stuck) fails the save,
naming rank 0.
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
        coordinator: this rank decides.
        timeout_s: the longest a rank waits for a verdict.
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
        """The coordinator's verdict on this rank: ``None`` if committed, else the error."""
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
