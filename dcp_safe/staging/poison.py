"""How one rank's staging failure fails the save on every rank, at once.

A staging failure on the staging thread (a torn snapshot, a re-planned layout the budget
refuses, a failed copy) fails that rank's staging future. In a single process that is the whole
story: the upload never starts and the error reaches the caller. Under a process group of
several ranks it is not: a rank whose staging future failed never enters DCP's collectives for
that save, so its healthy peers wait in them until their deadline, and then learn only that a
peer did not answer.

So under several ranks the failing rank hands DCP a *poisoned* state dict (:func:`poisoned`)
instead of failing its future: its one entry raises the rank's error from DCP's
``__create_write_items__`` hook while the local plan is made, inside DCP's collective, which
carries it to every rank. Nothing is written or published, and every rank's future fails with
the same error (mapped by :func:`dcp_safe.errors.from_checkpoint_exception`; a
:class:`~dcp_safe.errors.SnapshotMutatedError` names the torn rank). A planner that does not use
DCP's write-item helper serializes the entry instead, and its ``__reduce_ex__`` raises the same
error during ``write_data``, still inside the collective.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["POISON_KEY", "FailedStaging", "poisoned"]

# The key of the only entry of a poisoned state dict (a name no model uses).
POISON_KEY = "__dcp_safe_staging_failed__"


class FailedStaging:
    """The entry of a poisoned state dict: any attempt to plan or serialize it raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __create_write_items__(self, fqn: str, obj: object) -> NoReturn:
        # DCP's planner calls this while making the local plan, inside its collective.
        raise self.error

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise self.error

    def __deepcopy__(self, memo: dict[int, Any]) -> FailedStaging:
        return self

    def __repr__(self) -> str:
        return f"FailedStaging({self.error!r})"


def poisoned(error: Exception) -> dict[str, Any]:
    """A state dict whose save fails with ``error`` on every rank (see the module docstring)."""
    return {POISON_KEY: FailedStaging(error)}
