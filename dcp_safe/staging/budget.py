"""The host-memory envelope of a save and the admission test, as plain integer arithmetic.

The *envelope* is how many bytes of host memory staging may hold at once; the formula, the
admission rule and why the host is read once (the pool would otherwise be counted twice) are in
docs/staging.md, "The envelope". A budget carries this rank's *share* of its node
(``1 / LOCAL_WORLD_SIZE`` by default), so a node's ranks never over-commit it: docs/capacity.md,
"Many ranks on one node". Only :meth:`MemoryBudget.from_host` touches the host; everything else
is pure (the unit tests need neither torch nor threads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dcp_safe.choices import require_int
from dcp_safe.errors import BudgetExceededError, ConfigError
from dcp_safe.host_memory import read_host
from dcp_safe.units import format_bytes

# Shares are held as exact fractions for the arithmetic: 1/7 stays 1/7, not 0.142857...
_SHARE_MAX_DENOMINATOR = 1 << 20
_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class Admission:
    """The answer of the admission test: yes or no, a one-line reason with the figures, and the
    host memory left for everything else after staging, by the budget's arithmetic."""

    admitted: bool
    reason: str
    projected_available_bytes: int


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """The host-memory envelope for checkpoint staging, for this rank.

    Every size describes the whole node (or container); ``share`` (in ``(0, 1]``: ``1/8`` for one
    of 8 ranks on the node) says which part of the node's envelope is this rank's, and the
    per-rank properties are the node's figures times it. When ``training_peak_bytes`` is given,
    the envelope is ``usable - peak - other - reserve``; else ``available_bytes`` stands for
    ``usable - peak``; else all of ``usable_bytes`` counts as available. A negative size, a
    fraction outside ``[0, 1)``, a share outside ``(0, 1]`` or no usable RAM is a ConfigError.
    """

    usable_bytes: int  # the cgroup limit when set, else MemTotal
    training_peak_bytes: int | None = None  # the node's steady training RSS, all ranks
    available_bytes: int | None = None  # measured MemAvailable (or cgroup headroom)
    # What other consumers will take that the measurement does not show yet (a sidecar).
    other_consumers_bytes: int = 0
    reserve_bytes: int | None = None  # kept free for the OS and page cache; else the fraction
    reserve_fraction: float = 0.15  # of usable_bytes
    source: str = "given"  # how usable_bytes was found, for messages
    share: float = 1.0
    share_source: str = "given"

    def __post_init__(self) -> None:
        require_int("usable_bytes", self.usable_bytes, 1)
        require_int("other_consumers_bytes", self.other_consumers_bytes, 0)
        for name in ("training_peak_bytes", "available_bytes", "reserve_bytes"):
            if (value := getattr(self, name)) is not None:
                require_int(name, value, 0, " (or None when unknown)")
        if not 0.0 <= float(self.reserve_fraction) < 1.0:
            raise ConfigError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction!r}")
        share = self.share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError(
                f"share must be a number in (0, 1], this rank's fraction of the node's envelope"
                f" (1/8 for one of 8 ranks on the node), got {share!r}"
            )

    @property
    def node_reserve(self) -> int:
        given = self.reserve_bytes
        return int(self.usable_bytes * self.reserve_fraction) if given is None else given

    @property
    def reserve(self) -> int:
        # Rounded up, so the ranks' envelopes never sum to more than the node's.
        return -self._part(-self.node_reserve)

    @property
    def base_available_bytes(self) -> int:
        # This rank's part of what staging and the reserve may take before the stager holds any.
        return self._part(self._node_base_available_bytes)

    @property
    def envelope_bytes(self) -> int:
        return max(0, self.base_available_bytes - self.reserve)

    @property
    def node_envelope_bytes(self) -> int:
        return max(0, self._node_base_available_bytes - self.node_reserve)

    @property
    def _node_base_available_bytes(self) -> int:
        if self.training_peak_bytes is not None:
            base = self.usable_bytes - self.training_peak_bytes
        elif self.available_bytes is not None:
            base = min(self.available_bytes, self.usable_bytes)
        else:
            base = self.usable_bytes
        return base - self.other_consumers_bytes

    def _part(self, node_bytes: int) -> int:
        # Exact integer arithmetic on the fraction, rounded down: 1/8 of a figure is exact, and
        # N ranks' parts never sum to more than the node's figure.
        fraction = _share_fraction(self.share)
        return node_bytes * fraction.numerator // fraction.denominator

    def explain(self) -> str:
        reserve = f"reserve {format_bytes(self.node_reserve)}"
        if self.reserve_bytes is None:
            reserve += f" ({self.reserve_fraction:.0%} of usable)"
        usable = f"usable RAM {format_bytes(self.usable_bytes)}"
        start = f"{usable} ({self.source})"
        if self.training_peak_bytes is not None:
            start += f" - training peak {format_bytes(self.training_peak_bytes)}"
        elif self.available_bytes is not None:
            available = min(self.available_bytes, self.usable_bytes)
            start = f"MemAvailable {format_bytes(available)} ({usable}, {self.source})"
        node = (
            f"envelope {format_bytes(self.node_envelope_bytes)} = {start}"
            f" - other consumers {format_bytes(self.other_consumers_bytes)} - {reserve}"
        )
        if self.share == 1:
            return node
        share = f"share {_format_share(self.share)}"
        return (
            f"envelope {format_bytes(self.envelope_bytes)} = node envelope"
            f" {format_bytes(self.node_envelope_bytes)} x {share} ({self.share_source}):"
            f" available {format_bytes(self._node_base_available_bytes)} x {share}"
            f" = {format_bytes(self.base_available_bytes)} - reserve"
            f" {format_bytes(self.node_reserve)} x {share} = {format_bytes(self.reserve)};"
            f" node {node}"
        )

    def check_fits(self, request_bytes: int) -> None:
        # A state that could never be admitted, however long it waited.
        if request_bytes > self.envelope_bytes:
            raise BudgetExceededError(
                f"state needs {format_bytes(request_bytes)} of host staging memory, more than the"
                f" whole {self.explain()}; shard the state further, lower the training peak, or"
                " pass a larger budget"
            )

    def admit(
        self, *, request_bytes: int, projected_bytes: int, in_flight: int, max_in_flight: int
    ) -> Admission:
        """Whether one more generation, staging ``request_bytes`` (BudgetExceededError if it is
        more than the whole envelope), may start now; ``projected_bytes``: what the stager would
        hold in all, this generation included, after reusing what it can."""
        self.check_fits(request_bytes)
        available = self.base_available_bytes - projected_bytes
        if in_flight >= max_in_flight:
            busy = f"{in_flight} generation(s) in flight, max_in_flight={max_in_flight}"
            return Admission(False, busy, available)
        # Same test as ``projected_bytes > envelope_bytes``, including when the host is already
        # below its reserve (envelope 0): then only a save that stages nothing is admitted.
        fits = projected_bytes == 0 or available >= self.reserve
        staged = format_bytes(projected_bytes)
        how = "stays above" if fits else f"after staging {staged} would fall below"
        why = f"projected available memory {format_bytes(available)} {how} the reserve"
        return Admission(fits, f"{why} {format_bytes(self.reserve)}", available)

    @classmethod
    def from_host(
        cls,
        *,
        cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
        proc_self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
        local_world_size: int | None = None,
        share: float | None = None,
        **figures: Any,
    ) -> MemoryBudget:
        """Read usable RAM and available memory from this host, now; take this rank's share.

        The share is ``share`` (for ranks that do not split the node evenly), else one over
        ``local_world_size``, else over the ``LOCAL_WORLD_SIZE`` torchrun sets, else 1 (a
        ConfigError when out of range or not a positive integer). ``figures``: the node's other
        figures, as in the class. ``cgroup_root`` and ``proc_self_cgroup``: seams for tests.
        """
        rank_share, share_source = _resolve_share(local_world_size, share)
        usable, source, available = read_host(cgroup_root, proc_self_cgroup)
        return cls(
            usable_bytes=usable,
            available_bytes=available,
            source=source,
            share=rank_share,
            share_source=share_source,
            **figures,
        )


def _share_fraction(share: float) -> Fraction:
    return Fraction(share).limit_denominator(_SHARE_MAX_DENOMINATOR)


def _format_share(share: float) -> str:
    f = _share_fraction(share)
    return f"{f.numerator}/{f.denominator}" if f.denominator <= 1024 else f"{share:.6g}"


def _resolve_share(local_world_size: int | None, share: float | None) -> tuple[float, str]:
    if local_world_size is not None:
        require_int("local_world_size", local_world_size, 1, ", the number of ranks on this node")
    if share is not None:  # checked by the class, as a given share is
        return share, "share="
    if local_world_size is not None:
        return 1 / local_world_size, f"local_world_size={local_world_size}"
    raw = os.environ.get(_LOCAL_WORLD_SIZE, "").strip()
    if not raw:
        return 1.0, f"{_LOCAL_WORLD_SIZE} unset"
    ranks = int(raw) if raw.isdecimal() else 0
    if ranks < 1:
        raise ConfigError(
            f"{_LOCAL_WORLD_SIZE}={raw!r} is not a positive integer (torchrun sets it to the"
            " number of ranks on this node); fix the environment, or pass local_world_size="
            " or share= to MemoryBudget.from_host()"
        )
    return 1 / ranks, f"{_LOCAL_WORLD_SIZE}={ranks}"
