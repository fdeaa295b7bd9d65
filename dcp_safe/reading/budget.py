"""``LoadBudget``: the most transient host bytes a reader holds at once, and what it held.

Transient bytes are what a load allocates beyond the target state: an item's stored bytes read
into memory before they are copied into its tensor, a decompressed copy, a tensor built to be
narrowed or moved to another device. Each item's read is admitted against the budget at a cost
stated before anything is allocated (an upper bound: torchsnapshot's and orbax's
``read_concurrent_bytes`` scheme), and the bytes actually allocated are counted as they appear,
so ``peak_bytes`` is a measurement, not the sum of the estimates.

Admission is a byte semaphore in arrival order (a large item is not starved by small ones).
A cost larger than the whole budget is admitted alone, once nothing else is held: it can never
deadlock, and its bytes are then the bound. A reader thread holds one admission at a time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dcp_safe.choices import require_int


@dataclass(frozen=True, kw_only=True)
class LoadMemoryStats:
    """Transient host memory of the reads since the reader's last ``reset``.

    Attributes:
        budget_bytes: the bound reads were admitted against (``None``: none).
        peak_bytes: the most transient bytes held at once, counted as they were allocated.
        largest_item_bytes: the most one item held (the bound when it exceeds the budget).
        items_admitted: items that held transient bytes.
    """

    budget_bytes: int | None
    peak_bytes: int
    largest_item_bytes: int
    items_admitted: int


class Admission:
    """One item's place in the budget: ``count`` what it allocates."""

    def __init__(self, budget: LoadBudget) -> None:
        self._budget, self.held, self.counted = budget, 0, 0  # counted: 1 once it held any

    def count(self, nbytes: int) -> None:
        """``nbytes`` more held by this item (a buffer about to be, or just, allocated)."""
        budget, self.held, self.counted = self._budget, self.held + nbytes, 1
        with budget._cond:
            budget._held += nbytes
            budget._peak = max(budget._peak, budget._held)
            budget._largest = max(budget._largest, self.held)


class LoadBudget:
    """Admit item reads against ``budget_bytes`` (``None``: admit all at once, still counting);
    shared by a reader's threads.

    Raises:
        ConfigError: ``budget_bytes`` is neither a positive int nor ``None``.
    """

    def __init__(self, budget_bytes: int | None) -> None:
        if budget_bytes is not None:
            require_int("load_budget_bytes", budget_bytes, 1, " (bytes) or None for no bound")
        self.budget_bytes = budget_bytes
        self._cond = threading.Condition()
        self._reserved = 0  # the admitted items' stated costs
        self._waiting: collections.deque[object] = collections.deque()  # tickets, in order
        self._held = self._peak = self._largest = self._items = 0

    def reset_stats(self) -> None:
        with self._cond:
            self._peak, self._largest, self._items = self._held, 0, 0

    def stats(self) -> LoadMemoryStats:
        with self._cond:
            return LoadMemoryStats(
                budget_bytes=self.budget_bytes,
                peak_bytes=self._peak,
                largest_item_bytes=self._largest,
                items_admitted=self._items,
            )

    @contextmanager
    def admit(self, cost_bytes: int) -> Iterator[Admission]:
        """Hold a place for an item that allocates at most ``cost_bytes`` until the block ends
        (waiting, in arrival order, while it does not fit; alone when it never fits)."""
        with self._cond:
            if (budget := self.budget_bytes) is not None and cost_bytes:
                ticket = object()
                self._waiting.append(ticket)
                try:
                    self._cond.wait_for(
                        lambda: (
                            self._waiting[0] is ticket
                            and (self._reserved == 0 or self._reserved + cost_bytes <= budget)
                        )
                    )
                finally:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()
            self._reserved += cost_bytes
        admission = Admission(self)
        try:
            yield admission
        finally:
            with self._cond:
                self._items += admission.counted
                self._held -= admission.held
                self._reserved -= cost_bytes
                self._cond.notify_all()
