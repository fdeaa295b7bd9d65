"""The stager's options and its statistics: small frozen dataclasses, validated on creation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from dcp_safe.choices import parse_choice, require_int
from dcp_safe.errors import ConfigError
from dcp_safe.staging.pool import PinMemory


class WhenBusy(str, Enum):
    """What ``stage()`` does when a save cannot be admitted now.

    The stager's own admission, against its memory budget; not the manager's
    :class:`~dcp_safe.manager.handles.BusyPolicy`, which decides what a save request does while
    another save is in flight, before the stager is asked (a manager's own stager waits).
    """

    WAIT = "wait"  # wait up to ``timeout_s`` for a generation to be released
    RAISE = "raise"  # raise AdmissionTimeoutError at once (a wait of zero)


@dataclass(frozen=True, kw_only=True)
class StagerOptions:
    """Options of :class:`BudgetedStager` (a ConfigError for a value out of range).

    ``max_in_flight``: generations (staged, not yet released) at once. ``pin_memory``:
    ``"auto"`` pins when CUDA is available; ``"on"``, ``"off"`` or a bool. ``timeout_s``: the
    longest admission wait, and the longest ``close()`` waits for work in flight.
    ``mutation_guard``: fail a save whose sources change in place while they are copied
    (:mod:`dcp_safe.staging.guard`); turn off only to measure the guard's cost.
    """

    max_in_flight: int = 1
    pin_memory: PinMemory = PinMemory.AUTO
    when_busy: WhenBusy = WhenBusy.WAIT
    timeout_s: float = 600.0
    mutation_guard: bool = True

    def __post_init__(self) -> None:
        require_int("max_in_flight", self.max_in_flight, 1)
        # Callers may pass the modes' string values; store the enums.
        object.__setattr__(self, "pin_memory", PinMemory.coerce(self.pin_memory))
        object.__setattr__(self, "when_busy", parse_choice(WhenBusy, self.when_busy, "when_busy"))
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s >= 0:
            raise ConfigError(f"timeout_s must be a number >= 0, got {self.timeout_s!r}")
        if not isinstance(self.mutation_guard, bool):
            raise ConfigError(f"mutation_guard must be a bool, got {self.mutation_guard!r}")


#: Every keyword ``BudgetedStager`` took before ``options=``, and where it lives now.
STAGER_MOVED: Mapping[str, str] = {
    name: f"options=StagerOptions({name}=...)"
    for name in ("max_in_flight", "pin_memory", "when_busy", "timeout_s", "mutation_guard")
}


@dataclass
class StagerStats:
    """A stager's accounting, a copy from :meth:`BudgetedStager.stats` (bytes are host bytes as
    the allocator takes them)."""

    envelope_bytes: int = 0
    pool_bytes: int = 0  # held or reserved: free + in use + pending
    pinned_bytes: int = 0
    in_use_bytes: int = 0
    free_bytes: int = 0
    pending_bytes: int = 0  # released, still viewed from outside
    peak_pool_bytes: int = 0
    in_flight: int = 0  # admitted, not yet released
    peak_in_flight: int = 0
    allocations: int = 0
    allocated_bytes_total: int = 0
    last_allocated_bytes: int = 0  # by the latest completed staging (0 on reuse)
    reuses: int = 0
    admitted: int = 0
    refused: int = 0  # busy with when_busy="raise", or timed out
    total_wait_s: float = 0.0
    last_staging_s: float = 0.0  # the latest completed staging, call to Future resolved
    torn: int = 0  # generations the mutation guard failed
    plans_built: int = 0  # one per new layout of the state
    plan_reuses: int = 0  # saves (and warm-ups) that found their unchanged layout's plan
    kept_bytes: int = 0  # in use by the kept generation (track(keep=...)), not in flight
