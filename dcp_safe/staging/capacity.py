"""Capacity planning: does a checkpoint generation fit a node's host-memory envelope, and how many.

The operator's question before a run, with their own numbers: ``N`` overlapping generations fit
when ``N * (staged + buffer bytes) <= envelope``. The envelope is
:class:`~dcp_safe.staging.budget.MemoryBudget`'s own, so planning and the stager cannot drift.
Pure integer arithmetic; docs/capacity.md works an example.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcp_safe.choices import require_int
from dcp_safe.staging.budget import MemoryBudget
from dcp_safe.units import format_bytes

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Generation:
    """The host memory one checkpoint generation holds at its peak (planning arithmetic only;
    not the stager's :class:`~dcp_safe.staging.plan.InFlightGeneration`).

    ``buffer_bytes`` are the serialization, compression and writer buffers held while it is
    written. A negative or non-integer size is a ConfigError.
    """

    staged_bytes: int
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        require_int("staged_bytes", self.staged_bytes, 0)
        require_int("buffer_bytes", self.buffer_bytes, 0)

    @property
    def working_set_bytes(self) -> int:
        return self.staged_bytes + self.buffer_bytes


@dataclass(frozen=True)
class CapacityPlan:
    """The answer of :func:`plan_capacity`; a negative ``headroom_bytes`` is the shortfall."""

    envelope_bytes: int
    generation_bytes: int
    generations: int
    needed_bytes: int
    fits: bool
    headroom_bytes: int
    max_generations: int

    def explain(self) -> str:
        verdict = "fit" if self.fits else "do NOT fit"
        return (
            f"{self.generations} generation(s) x {format_bytes(self.generation_bytes)}"
            f" = {format_bytes(self.needed_bytes)} {verdict} the envelope of"
            f" {format_bytes(self.envelope_bytes)} (headroom {format_bytes(self.headroom_bytes)});"
            f" at most {self.max_generations} in flight"
        )


def node_budget(
    *, usable_bytes: int, training_peak_bytes: int, other_consumers_bytes: int, reserve_bytes: int
) -> MemoryBudget:
    """A :class:`MemoryBudget` for a node described by the operator's own measurements, which a
    :class:`~dcp_safe.staging.stager.BudgetedStager` on that node can take as it is."""
    return MemoryBudget(
        usable_bytes=usable_bytes,
        training_peak_bytes=training_peak_bytes,
        other_consumers_bytes=other_consumers_bytes,
        reserve_bytes=reserve_bytes,
        source="planned",
    )


def max_generations(budget: MemoryBudget, generation: Generation) -> int:
    """How many overlapping generations fit ``budget``'s envelope (a generation of 0 B: 0)."""
    working_set = generation.working_set_bytes
    return 0 if working_set == 0 else budget.envelope_bytes // working_set


def plan_capacity(
    budget: MemoryBudget, generation: Generation, *, generations: int = 1
) -> CapacityPlan:
    """Whether ``generations`` overlapping generations (the stager's ``max_in_flight``; a
    ConfigError unless a positive int) fit ``budget``'s envelope."""
    require_int("generations", generations, 1)
    envelope, each = budget.envelope_bytes, generation.working_set_bytes
    needed = generations * each
    most = max_generations(budget, generation)
    return CapacityPlan(
        envelope, each, generations, needed, needed <= envelope, envelope - needed, most
    )
