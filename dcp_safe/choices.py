"""Checking an option once, with one error for a bad value: a mode spelled as a string, a count,
a number of seconds.

Modes are ``str`` enums (``when_busy="skip"``, ``compression="zstd"``), so users may pass the
enum or its value; every component parses them here, and checks its counts and durations here,
so every bad value reads alike.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from dcp_safe.errors import ConfigError

E = TypeVar("E", bound=enum.Enum)


def parse_choice(kind: type[E], value: object, field: str) -> E:
    """``kind(value)``, or a :class:`~dcp_safe.errors.ConfigError` that names ``field`` and
    lists the allowed values."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{field} must be one of {choices}, got {value!r}") from None


def require_int(
    name: str, value: object, minimum: int, note: str = "", *, maximum: int | None = None
) -> int:
    """``value``, or a ConfigError unless it is an int (not a bool) from ``minimum`` to
    ``maximum``; ``note`` follows the range in the message."""
    highest = math.inf if maximum is None else maximum
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= highest:
        kind = f"an int >= {minimum}" if maximum is None else f"an int in {minimum}..{maximum}"
        raise ConfigError(f"{name} must be {kind}{note}, got {value!r}")
    return value


def seconds(name: str, value: object, *, zero_ok: bool = False) -> float:
    """``value`` as a float, or a ConfigError unless it is a finite number of seconds > 0 (or
    0, with ``zero_ok``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (value > 0 or (zero_ok and value == 0))
    ):
        kind = "a non-negative" if zero_ok else "a positive"
        raise ConfigError(f"{name} must be {kind} number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite: nothing may wait forever, got {value!r}")
    return float(value)


def refuse_moved(owner: str, keywords: Mapping[str, Any], moved: Mapping[str, str]) -> None:
    """Raise for the first of ``keywords`` (what ``owner``'s ``**`` caught): a ConfigError
    naming where a keyword of an earlier layout went (``moved``: name -> its place now, where
    ``{name}`` stands for it), else a ``TypeError`` as Python's own."""
    for name in keywords:
        if name in moved:
            where = moved[name].format(name=name)
            raise ConfigError(f"{owner}({name}=) moved to {where} (docs/manager.md)")
        raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
