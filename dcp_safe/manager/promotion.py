"""Starting a coalesced save on every rank together, however long each rank's last save takes.

Under ``when_busy="coalesce"`` a request that finds a save in flight is parked as the pending
save, on every rank alike (the ranks voted), and starts once the save in flight has ended. The
ranks' saves end at different times: rank 0 may be minutes into its follow-up (retention on a
busy file system, deep verification) while rank 1 is idle. Starting the pending save as soon as
a rank is free would put that rank in DCP's first collective, which gives up after the deadline
and breaks its group. So each rank, once free, *arrives* at the pending save's barrier, and the
save starts only when every rank has arrived.

The barrier lives in the default group's key-value store, not on a gloo group: a store ``wait``
that times out breaks nothing. Its bound is the manager's ``wait_timeout_s`` (how long a rank
may wait for a peer's save in flight). Whoever decides the barrier's outcome does so with one
``compare_set`` on its state key, so every rank reads the same outcome:

* the last rank to arrive sets ``go``: every rank starts the save;
* a rank whose wait ran out (or that dropped the pending save: a preemption) sets
  ``abandoned`` first: every rank skips the pending save, as ``when_busy="wait"`` skips a
  request still blocked at ``wait_timeout_s`` (its handle is cancelled and the skip recorded
  with the ranks that never arrived), and starts nothing.

Keys are ``dcp_safe/manager/<token>/coalesced/<seq>/...``: the token is agreed when the manager
is built, ``seq`` counts the ranks' agreed coalesce decisions, so it is the same everywhere. A
few small keys stay in the store per coalesced save.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from dcp_safe.manager.agreement import Agreement
from dcp_safe.torch_compat import default_store

__all__ = ["PromotionBarrier"]

_GO = b"go"
_ABANDONED = b"abandoned"


class PromotionBarrier:
    """Where the ranks meet before a coalesced save starts.

    Args:
        store: the default group's store (``dcp_safe.torch_compat.default_store()``).
        token: the manager's agreed key prefix.
        rank, world_size: this rank and the number of ranks.
        timeout_s: the longest a rank waits for its peers (``wait_timeout_s``).
    """

    def __init__(
        self, store: Any, token: str, *, rank: int, world_size: int, timeout_s: float
    ) -> None:
        self._store = store
        self._prefix = f"dcp_safe/manager/{token}/coalesced"
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

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
        """Arrive at barrier ``seq`` and wait until every rank has, or the barrier is abandoned.

        Returns:
            ``None``: every rank starts the save; else why it was abandoned (the same outcome
            on every rank), naming the ranks that did not arrive.
        """
        key = f"{self._prefix}/{seq}"
        self._store.append(f"{key}/arrived", f"{self.rank},")
        if self._store.add(f"{key}/count", 1) == self.world_size:
            self._store.compare_set(f"{key}/state", "", _GO.decode())
        try:
            self._store.wait([f"{key}/state"], timedelta(seconds=self.timeout_s))
        except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
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
