"""Ratios and the regression guard: pure functions over benchmark JSON, no timing.

A benchmark result carries ``"ratios"``: ``{name: {"value": float, "better": "lower" |
"higher", "description": str}}``. Ratios, not seconds, because a ratio of two contenders
measured in the same run on the same (shared, noisy) machine survives a change of machine or
load far better than either figure alone.

:func:`compare_ratios` flags every ratio that got worse than a previous run's by more than a
relative ``tolerance``: for a lower-is-better ratio, ``(current - previous) / previous >
tolerance``; for a higher-is-better one, ``(previous - current) / previous > tolerance``.
Ratios present in only one of the two runs are reported by :func:`unmatched`, never flagged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dcp_safe.errors import ConfigError

Better = Literal["lower", "higher"]


def make_ratio(value: float, better: Better, description: str) -> dict[str, Any]:
    """One entry of a result's ``"ratios"``."""
    return {"value": float(value), "better": better, "description": description}


@dataclass(frozen=True, kw_only=True)
class Regression:
    """A ratio that worsened beyond the tolerance.

    Attributes:
        name: the ratio's name.
        previous: its value in the earlier run.
        current: its value now.
        better: which direction is an improvement.
        worsening: relative worsening (0.3 = 30% worse).
    """

    name: str
    previous: float
    current: float
    better: Better
    worsening: float

    def message(self, tolerance: float) -> str:
        """A one-line explanation for the terminal."""
        return (
            f"{self.name}: {self.previous:.3f} -> {self.current:.3f} ({self.better} is better),"
            f" {100 * self.worsening:.0f}% worse, beyond the {100 * tolerance:.0f}% tolerance"
        )


def _entries(result: Mapping[str, Any], which: str) -> Mapping[str, Any]:
    ratios = result.get("ratios")
    if not isinstance(ratios, Mapping):
        raise ConfigError(f"the {which} result has no 'ratios' mapping; is it a bench JSON?")
    return ratios


def _value(entry: Any, name: str) -> tuple[float, Better]:
    try:
        value, better = float(entry["value"]), entry["better"]
    except (TypeError, KeyError, ValueError) as exc:
        raise ConfigError(f"ratio {name!r} is malformed: {entry!r}") from exc
    if better not in ("lower", "higher"):
        raise ConfigError(f"ratio {name!r}: 'better' must be 'lower' or 'higher', got {better!r}")
    return value, better


def worsening(previous: float, current: float, better: Better) -> float:
    """Relative worsening from ``previous`` to ``current`` (negative: an improvement)."""
    if not (math.isfinite(previous) and math.isfinite(current)) or previous <= 0:
        return math.inf if not math.isfinite(current) else 0.0
    change = (current - previous) / previous
    return change if better == "lower" else -change


def compare_ratios(
    previous: Mapping[str, Any], current: Mapping[str, Any], tolerance: float
) -> list[Regression]:
    """Every ratio present in both results that worsened by more than ``tolerance``.

    Args:
        previous: the earlier result (its ``"ratios"`` are read).
        current: the new result.
        tolerance: allowed relative worsening, e.g. 0.25.

    Raises:
        ConfigError: a negative or non-finite tolerance, or a result without valid ratios.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ConfigError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    before, now = _entries(previous, "previous"), _entries(current, "current")
    found = []
    for name in sorted(set(before) & set(now)):
        old, better = _value(before[name], name)
        new, _ = _value(now[name], name)
        worse = worsening(old, new, better)
        if worse > tolerance:
            found.append(
                Regression(name=name, previous=old, current=new, better=better, worsening=worse)
            )
    return found


def unmatched(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Names of ratios present in only one of the two results, marked ``(new)``/``(gone)``."""
    before, now = set(_entries(previous, "previous")), set(_entries(current, "current"))
    return [f"{n} (new)" for n in sorted(now - before)] + [
        f"{n} (gone)" for n in sorted(before - now)
    ]
