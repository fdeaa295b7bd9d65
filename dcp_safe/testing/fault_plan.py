"""What a drill injects: :class:`FaultPlan` (which operations fail, how, how often) and the
exceptions an injected fault raises. :mod:`dcp_safe.testing.faulty_fs` carries it out."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from dcp_safe.errors import ConfigError

__all__ = ["MAX_HANG_S", "OPERATION_KINDS", "FaultError", "FaultPlan", "InjectedFault"]

OPERATION_KINDS = (
    "open",
    "write",
    "close",
    "read",
    "pipe",
    "info",
    "list",
    "mkdir",
    "move",
    "remove",
    "copy",
    "other",
)
# A hang is bounded: a drill must never be able to wedge a test run.
MAX_HANG_S = 600.0


class FaultError(str, enum.Enum):
    """The error a failing operation raises."""

    EIO = "eio"  # OSError(EIO): a final error, never retried
    ENOSPC = "enospc"  # OSError(ENOSPC): disk or quota full, final
    TIMEOUT = "timeout"  # TimeoutError: transient, dcp_safe's retry layer retries it
    CONNECTION = "connection"  # ConnectionResetError: transient


class InjectedFault:
    """Marker mixed into every injected error, so a test can tell injected from real ones."""


class _InjectedOSError(InjectedFault, OSError):
    pass


class _InjectedTimeout(InjectedFault, TimeoutError):
    pass


class _InjectedConnectionReset(InjectedFault, ConnectionResetError):
    pass


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """What to inject, and where. All counting is over the operations ``ops`` selects.

    Args:
        seed: seeds the random choices (probabilities, which byte flips): the same plan on the
            same sequence of operations injects the same faults.
        ops: operation kinds the plan applies to (see the module docstring); empty = all.
            Other operations pass through untouched (still counted in ``counts``).
        delay_s: sleep this long before each selected operation ("slow storage").
        fail_at: fail the ``fail_at``-th selected operation (1-based).
        persistent: with ``fail_at``, fail every selected operation from then on.
        fail_probability: fail each selected operation with this probability.
        error: what a failing operation raises.
        hang_s: a failing operation first hangs this long (bounded by ``MAX_HANG_S``), as a
            request that times out does.
        torn: a failing ``write``/``pipe`` first stores the first half of its data (a
            ``pipe`` to an object store never tears: a PUT lands whole or not at all).
        flip_probability: each selected ``write``/``pipe``/``read`` silently has one byte of its
            data flipped with this probability (silent corruption; S3 part bodies excepted).

    Raises:
        ConfigError: a value out of range, an unknown kind or error, or ``persistent`` without
            ``fail_at``.
    """

    seed: int = 0
    ops: tuple[str, ...] = ()
    delay_s: float = 0.0
    fail_at: int | None = None
    persistent: bool = False
    fail_probability: float = 0.0
    error: FaultError | str = FaultError.EIO
    hang_s: float = 0.0
    torn: bool = True
    flip_probability: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        unknown = sorted(set(ops) - set(OPERATION_KINDS))
        if unknown:
            raise ConfigError(f"unknown operation kinds {unknown}; known: {OPERATION_KINDS}")
        object.__setattr__(self, "ops", ops)
        _check_seconds("delay_s", self.delay_s, MAX_HANG_S)
        _check_seconds("hang_s", self.hang_s, MAX_HANG_S)
        if self.fail_at is not None and (
            not isinstance(self.fail_at, int) or isinstance(self.fail_at, bool) or self.fail_at < 1
        ):
            raise ConfigError(f"fail_at must be an int >= 1 or None, got {self.fail_at!r}")
        if self.persistent and self.fail_at is None:
            raise ConfigError("persistent=True needs fail_at: the first operation to fail")
        _check_probability("fail_probability", self.fail_probability)
        _check_probability("flip_probability", self.flip_probability)
        try:
            object.__setattr__(self, "error", FaultError(self.error))
        except ValueError:
            known = [e.value for e in FaultError]
            raise ConfigError(f"error must be one of {known}, got {self.error!r}") from None

    def selects(self, kind: str) -> bool:
        """Whether the plan applies to operations of ``kind``."""
        return not self.ops or kind in self.ops


def _check_seconds(name: str, value: object, limit: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and 0 <= value <= limit):
        raise ConfigError(f"{name} must be between 0 and {limit} s, got {value!r}")


def _check_probability(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a probability in [0, 1], got {value!r}")
