"""Coordination through the default group's store: the promotion barrier and the verdicts.

The store, not a gloo group: a store wait that times out breaks nothing, where a gloo collective
would break its group. Both keep a few small keys per save under the manager's agreed token.

:class:`PromotionBarrier` starts a coalesced save on every rank together. Each rank, once its
save in flight has ended, arrives; the last one sets ``go``, a rank whose wait ran out (or that
dropped the pending save) sets ``abandoned``: one ``compare_set`` decides, so every rank reads
the same outcome. See docs/multirank.md, "When one rank is slow" (coalesce).

:class:`Verdicts` gives one outcome per save on every rank: the coordinator's. Each rank's own
check of a new checkpoint can disagree (a second-long outage fails rank 0's read and not rank
1's), so the coordinator checks and posts its verdict and the others adopt it; a rank's own
failure is not a verdict, as the coordinator checked every rank's part before it published. Keys
count saves per name, so they match whatever order a background and a foreground follow-up run in.
The verdict key is decided once, as the barrier's state is: the coordinator posts with
``compare_set``, a rank whose wait ran out claims it failed the same way, and every rank (the
coordinator too) adopts the one value that won. A coordinator whose ``ok`` lost withdraws the
checkpoint it committed (``SaveRunner.after_commit``). The remote tier's outcome of a replicated
save is decided the same way, under its own key: a rank that gave up waiting for rank 0's
remote commit and a rank 0 whose commit retried through an outage and succeeded then agree.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from dcp_safe.coordination.agreement import Agreement
from dcp_safe.errors import CommitError, DcpSafeError, ReplicationSkippedError
from dcp_safe.torch_compat import default_store

_GO = b"go"
_ABANDONED = b"abandoned"
_OK = "ok"
_FAILED = "failed:"
_EXPIRED = "expired:"  # a rank's wait ran out first: the save failed, on every rank alike
_SKIPPED = "skipped:"  # the replication was superseded: a skip on every rank, not a failure
_MAX_REASON = 2000


def wait_for(store: Any, key: str, timeout_s: float) -> bool:
    """Wait until ``key`` is set in ``store``; False when ``timeout_s`` passed first."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
        return False
    return True


class PromotionBarrier:
    """Where the ranks meet before a coalesced save starts; ``timeout_s`` (``wait_timeout_s``)
    is the longest a rank waits for its peers."""

    def __init__(
        self, store: Any, token: str, *, rank: int, world_size: int, timeout_s: float
    ) -> None:
        self._store, self._prefix = store, f"dcp_safe/manager/{token}/coalesced"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    @classmethod
    def for_job(cls, agreement: Agreement, timeout_s: float) -> PromotionBarrier | None:
        """The barrier of a manager's ranks (``None`` in a single process: nobody to meet)."""
        if not agreement.distributed:
            return None
        return cls(
            default_store(),
            agreement.token,
            rank=agreement.rank,
            world_size=agreement.world_size,
            timeout_s=timeout_s,
        )

    def cross(self, seq: int, step: int) -> str | None:
        """Arrive at barrier ``seq`` and wait until every rank has (``None``: every rank starts
        the save), or the barrier is abandoned: why, naming the ranks that did not arrive (the
        same outcome on every rank)."""
        key = f"{self._prefix}/{seq}"
        self._store.append(f"{key}/arrived", f"{self.rank},")
        if self._store.add(f"{key}/count", 1) == self.world_size:
            self._store.compare_set(f"{key}/state", "", _GO.decode())
        if not wait_for(self._store, f"{key}/state", self.timeout_s):
            self._store.compare_set(f"{key}/state", "", _ABANDONED.decode())
        if self._store.get(f"{key}/state") == _GO:
            return None
        return self._abandoned(key, step)

    def abandon(self, seq: int) -> None:
        """Give up barrier ``seq`` without arriving (this rank dropped the pending save)."""
        self._store.compare_set(f"{self._prefix}/{seq}/state", "", _ABANDONED.decode())

    def _abandoned(self, key: str, step: int) -> str:
        raw = self._store.get(f"{key}/arrived") if self._store.check([f"{key}/arrived"]) else b""
        arrived = {int(r) for r in raw.decode().split(",") if r.strip().isdigit()}
        missing = [r for r in range(self.world_size) if r not in arrived]
        who = (
            f"rank(s) {', '.join(map(str, missing))} had not finished their previous save"
            if missing
            else "the last rank finished its previous save"
        )
        return (
            f"coalesced save of step {step} dropped on every rank: {who} after"
            f" {self.timeout_s:g} s (wait_timeout_s), or dropped it"
        )


class Verdicts:
    """Post (coordinator) and await (everyone else) the outcome of each save."""

    def __init__(self, store: Any, token: str, *, coordinator: bool, timeout_s: float) -> None:
        self._store, self._prefix = store, f"dcp_safe/manager/{token}/verdict"
        self.coordinator, self.timeout_s = coordinator, timeout_s
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

    def key_for(self, name: str, tier: str = "local") -> str:
        """The key of the next verdict on ``name`` in ``tier`` (one per save of that name)."""
        with self._lock:
            self._counts[tier + name] = count = self._counts.get(tier + name, 0) + 1
        return f"{self._prefix}/{tier}/{name}/{count}"

    def post(self, key: str, failure: BaseException | None) -> DcpSafeError | None:
        """The coordinator's verdict: committed (``failure`` is ``None``) or why not. Returns
        the verdict every rank adopts (as :meth:`await_verdict`): its own, unless a rank whose
        wait ran out claimed the key first."""
        if isinstance(failure, ReplicationSkippedError):
            text = _SKIPPED + failure.superseded_by
        else:
            text = _OK if failure is None else _FAILED + f"{type(failure).__name__}: {failure}"
        self._store.compare_set(key, "", text[:_MAX_REASON])
        return self._decided(key)

    def await_verdict(self, key: str) -> DcpSafeError | None:
        """The coordinator's verdict on this rank: ``None`` if committed, else the error (also
        a ``CommitError`` naming rank 0 when none came within ``timeout_s``: then this rank
        claims the key, so that a verdict landing later loses on every rank)."""
        if not wait_for(self._store, key, self.timeout_s):
            self._store.compare_set(key, "", f"{_EXPIRED}{self.timeout_s:g}")
        return self._decided(key)

    def _decided(self, key: str) -> DcpSafeError | None:
        """The value that won ``key``, as every rank reads it."""
        text = self._store.get(key).decode("utf-8", errors="replace")
        if text == _OK:
            return None
        if text.startswith(_SKIPPED):
            return ReplicationSkippedError(key.rsplit("/", 2)[-2], text[len(_SKIPPED) :])
        if text.startswith(_EXPIRED):
            return CommitError(
                "no verdict on the save from the coordinator",
                {0: f"did not report whether the save committed within {text[len(_EXPIRED) :]} s"},
            )
        return CommitError(
            "the coordinator found the save not committed", {0: text[len(_FAILED) :]}
        )
