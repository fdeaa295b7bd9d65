"""How one rank's staging failure fails the save on every rank, at once.

Under several ranks, a rank whose staging future failed would never enter DCP's collectives,
and its peers would wait there until their deadline. So the failing rank hands DCP a *poisoned*
state dict instead: its one entry raises the rank's error from ``__create_write_items__`` while
the local plan is made, inside DCP's collective, which carries it to every rank (a planner that
does not use that hook serializes the entry, and ``__reduce_ex__`` raises the same error). In
one process the staging future simply fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

# The key of the only entry of a poisoned state dict (a name no model uses).
POISON_KEY = "__dcp_safe_staging_failed__"


@dataclass(eq=False)
class FailedStaging:
    # The entry of a poisoned state dict: any attempt to plan or serialize it raises ``error``.
    error: Exception

    def __create_write_items__(self, fqn: str, obj: object) -> NoReturn:
        # DCP's planner calls this while making the local plan, inside its collective.
        raise self.error

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise self.error

    def __deepcopy__(self, memo: dict[int, Any]) -> FailedStaging:
        return self


def poisoned(error: Exception) -> dict[str, Any]:
    return {POISON_KEY: FailedStaging(error)}
