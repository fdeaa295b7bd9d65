"""Retention as pure functions: which committed checkpoints to keep and which to drop.

It touches no storage (``dcp_safe.manager`` and ``apply`` do the IO). A policy names the
checkpoints it wants kept (:class:`KeepLast`, :class:`KeepEvery`, :class:`KeepBest`,
:class:`KeepWithin`, or their union through :func:`combine`), and :func:`decide` adds the
safety rules that no policy can override:

1. the newest committed checkpoint is never dropped;
2. only checkpoints older than the newest *validated* one are ever dropped (nothing is dropped
   while no checkpoint is validated), so a run whose latest saves fail verification keeps the
   history it needs to roll back;
3. at least two validated checkpoints are kept (all of them if fewer exist): when the policy and
   rules 1, 2 and 4 keep fewer, the newest validated ones not yet kept are added until two are,
   so a policy such as ``keep_best`` keeps exactly what it names once that holds two validated;
4. names in ``protected`` (being read, being replicated) are kept.

Why a union of keeps rather than orbax's chain of filters: every policy then only ever *adds*
checkpoints to keep, so combining policies can never drop something one of them wanted (rule 3
may then have less to add).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dcp_safe.choices import require_int, seconds
from dcp_safe.errors import ConfigError


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint as retention sees it: its ``step`` orders checkpoints (then
    ``name``); ``validated``: it passed verification after its commit; its commit time (the
    writer's clock) is for :class:`KeepWithin`, its save's ``metrics`` for :class:`KeepBest`."""

    name: str
    step: int
    validated: bool
    created_at: float = 0.0
    metrics: Mapping[str, float | str] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class RetentionDecision:
    """What :func:`decide` keeps and drops, each oldest first."""

    keep: tuple[str, ...]
    drop: tuple[str, ...]


class RetentionPolicy(Protocol):
    """Names, among ``records`` (oldest first), the checkpoints a policy wants kept."""

    def keeps(self, records: Sequence[CheckpointRecord]) -> set[str]: ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` newest checkpoints."""

    n: int

    def __post_init__(self) -> None:
        require_int("KeepLast's n", self.n, 0)

    def keeps(self, records: Sequence[CheckpointRecord]) -> set[str]:
        # max(0, ...): with fewer records than n, a negative start would count from the end
        # and keep only the newest few; n = 0 starts past the end and keeps none.
        return {r.name for r in _ordered(records)[max(0, len(records) - self.n) :]}


@dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``k``."""

    k: int

    def __post_init__(self) -> None:
        require_int("KeepEvery's k", self.k, 1)

    def keeps(self, records: Sequence[CheckpointRecord]) -> set[str]:
        return {r.name for r in records if r.step % self.k == 0}


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` checkpoints with the lowest (``mode="min"``) or highest (``"max"``)
    number under ``metric``; one without it, or with a label there, is never among the best.
    Ties go to the newer checkpoint."""

    k: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        require_int("keep_best's k", self.k, 1)
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"keep_best needs a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"keep_best's mode must be 'min' or 'max', got {self.mode!r}")

    def keeps(self, records: Sequence[CheckpointRecord]) -> set[str]:
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted(
            (sign * value, -r.step, r.name)
            for r in records
            if isinstance(value := (r.metrics or {}).get(self.metric), float)
        )
        return {name for _, _, name in ranked[: self.k]}


@dataclass(frozen=True)
class KeepWithin:
    """Keep every checkpoint committed at most ``seconds`` before the newest one did.

    Measured from the newest checkpoint, not from now: a decision is a function of the records
    alone, and a run that stopped for a week still keeps its last ``seconds`` of history.
    """

    seconds: float

    def __post_init__(self) -> None:
        seconds("keep_within_s", self.seconds, zero_ok=True)

    def keeps(self, records: Sequence[CheckpointRecord]) -> set[str]:
        newest = max((r.created_at for r in records), default=0.0)
        return {r.name for r in records if r.created_at >= newest - self.seconds}


@dataclass(frozen=True)
class _Union:
    policies: tuple[RetentionPolicy, ...]

    def keeps(self, records: Sequence[CheckpointRecord]) -> set[str]:
        return set().union(*(policy.keeps(records) for policy in self.policies))


def combine(*policies: RetentionPolicy) -> RetentionPolicy:
    """A policy that keeps what any of ``policies`` keeps (none: keep nothing by policy)."""
    return _Union(tuple(policies))


def decide(
    records: Sequence[CheckpointRecord],
    policy: RetentionPolicy,
    *,
    protected: Collection[str] = frozenset(),
) -> RetentionDecision:
    """Split ``records`` (in any order; ConfigError if two share a name) into keep and drop:
    the policy's keeps plus the safety rules; ``protected`` names (being read or replicated)
    are never dropped now."""
    ordered = _ordered(records)
    if len({r.name for r in ordered}) != len(ordered):
        raise ConfigError("retention records must have distinct names")
    keep = policy.keeps(ordered) | (set(protected) & {r.name for r in ordered})
    validated = [i for i, r in enumerate(ordered) if r.validated]
    cutoff = validated[-1] if validated else 0
    keep |= {r.name for r in ordered[cutoff:]}  # the newest validated and everything after
    kept_validated = sum(ordered[i].name in keep for i in validated)
    missing = [ordered[i].name for i in reversed(validated) if ordered[i].name not in keep]
    keep |= set(missing[: max(0, 2 - kept_validated)])
    return RetentionDecision(
        keep=tuple(r.name for r in ordered if r.name in keep),
        drop=tuple(r.name for r in ordered if r.name not in keep),
    )


def _ordered(records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    return sorted(records, key=lambda r: (r.step, r.name))
