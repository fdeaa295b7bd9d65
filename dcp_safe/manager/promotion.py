"""Starting a coalesced save on every rank together: a barrier in the default group's store.

Each rank, once its save in flight has ended, arrives; the last one sets ``go``, a rank whose
wait ran out (or that dropped the pending save) sets ``abandoned``: one ``compare_set`` decides,
so every rank reads the same outcome. A store wait that times out breaks nothing, where a gloo
collective would break its group. See docs/multirank.md, "When one rank is slow" (coalesce).
A few small keys stay in the store per coalesced save.
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
        store: the default group's store.
        token: the manager's agreed key prefix.
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
