"""Capacity planning: does a checkpoint generation fit a node's host-memory envelope, and how many.

This module owns the *planning* question an operator asks before a run, with their own numbers:
given a node (usable RAM, the training peak, loaders and services, an OS reserve) and one
checkpoint generation (staged bytes plus writer/transform buffers), does one generation fit the
envelope, and do ``N`` overlapping generations? The envelope is the same one the stager enforces
at run time, so it is computed by :class:`~dcp_safe.staging.budget.MemoryBudget` itself (same
field names, same arithmetic) rather than a second formula that could drift from it::

    envelope   = usable RAM - training peak - other consumers - reserve
    generation = staged bytes + buffer bytes
    N overlapping generations fit  <=>  N * generation <= envelope

Pure integer arithmetic: no torch, no threads, no reading of the host (``MemoryBudget.from_host``
is the one place that measures; pass its result here to plan against the live host).
"""

from __future__ import annotations

from dataclasses import dataclass

from dcp_safe.errors import ConfigError
from dcp_safe.staging.budget import MemoryBudget
from dcp_safe.units import format_bytes

__all__ = ["GIB", "CapacityPlan", "Generation", "max_generations", "node_budget", "plan_capacity"]

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Generation:
    """The host memory one checkpoint generation holds at its peak (planning arithmetic only).

    The stager's own record of an admitted save is
    :class:`~dcp_safe.staging.generation.InFlightGeneration`, a different thing.

    Args:
        staged_bytes: the staged copy of the state (this node's shards).
        buffer_bytes: serialization, compression and writer buffers held while it is written.

    Raises:
        ConfigError: a negative or non-integer size.
    """

    staged_bytes: int
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("staged_bytes", "buffer_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")

    @property
    def working_set_bytes(self) -> int:
        """Staged bytes plus buffers."""
        return self.staged_bytes + self.buffer_bytes


@dataclass(frozen=True)
class CapacityPlan:
    """The answer of :func:`plan_capacity`.

    Attributes:
        envelope_bytes: what checkpoint staging may hold at once on this node.
        generation_bytes: one generation's working set.
        generations: how many overlapping generations were asked about.
        needed_bytes: ``generations * generation_bytes``.
        fits: ``needed_bytes <= envelope_bytes``.
        headroom_bytes: ``envelope_bytes - needed_bytes``; negative is the shortfall.
        max_generations: the most overlapping generations that fit (0: not even one).
    """

    envelope_bytes: int
    generation_bytes: int
    generations: int
    needed_bytes: int
    fits: bool
    headroom_bytes: int
    max_generations: int

    def explain(self) -> str:
        """One line with the figures and the verdict."""
        verdict = "fit" if self.fits else "do NOT fit"
        return (
            f"{self.generations} generation(s) x {format_bytes(self.generation_bytes)}"
            f" = {format_bytes(self.needed_bytes)} {verdict} the envelope of"
            f" {format_bytes(self.envelope_bytes)} (headroom {format_bytes(self.headroom_bytes)});"
            f" at most {self.max_generations} in flight"
        )


def node_budget(
    *,
    usable_bytes: int,
    training_peak_bytes: int,
    other_consumers_bytes: int,
    reserve_bytes: int,
) -> MemoryBudget:
    """A :class:`MemoryBudget` for a node described by the operator's own measurements.

    Every argument is in bytes (``512 * GIB``). The same object can be handed to
    :class:`~dcp_safe.staging.stager.BudgetedStager` on that node.
    """
    return MemoryBudget(
        usable_bytes=usable_bytes,
        training_peak_bytes=training_peak_bytes,
        other_consumers_bytes=other_consumers_bytes,
        reserve_bytes=reserve_bytes,
        source="planned",
    )


def max_generations(budget: MemoryBudget, generation: Generation) -> int:
    """How many overlapping generations fit ``budget``'s envelope (a generation of 0 B: 0)."""
    if generation.working_set_bytes == 0:
        return 0
    return budget.envelope_bytes // generation.working_set_bytes


def plan_capacity(
    budget: MemoryBudget, generation: Generation, *, generations: int = 1
) -> CapacityPlan:
    """Whether ``generations`` overlapping generations fit ``budget``'s envelope.

    Args:
        budget: the node's envelope (:func:`node_budget`, or ``MemoryBudget.from_host()``).
        generation: one generation's staged bytes and buffers.
        generations: how many may overlap (``max_in_flight``; 1 is single-flight).

    Raises:
        ConfigError: ``generations`` is not a positive int.
    """
    if not isinstance(generations, int) or isinstance(generations, bool) or generations < 1:
        raise ConfigError(f"generations must be an int >= 1, got {generations!r}")
    envelope = budget.envelope_bytes
    needed = generations * generation.working_set_bytes
    return CapacityPlan(
        envelope_bytes=envelope,
        generation_bytes=generation.working_set_bytes,
        generations=generations,
        needed_bytes=needed,
        fits=needed <= envelope,
        headroom_bytes=envelope - needed,
        max_generations=max_generations(budget, generation),
    )
