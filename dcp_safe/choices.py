"""Options spelled as strings: parsing a ``str`` enum once, with one error for a bad value.

Modes are ``str`` enums (``when_busy="skip"``, ``compression="zstd"``), so users may pass the
enum or its value; every component parses them here, so every bad value reads alike.

A component that takes its options both as keywords and as one dataclass (``options=``, as DCP
takes its ``StagingOptions``) checks here that the two agree, so every clash reads alike too.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

from dcp_safe.errors import ConfigError

__all__ = ["check_agrees", "parse_choice", "refuse_moved"]

E = TypeVar("E", bound=enum.Enum)


def parse_choice(kind: type[E], value: object, field: str) -> E:
    """``kind(value)``, or a :class:`~dcp_safe.errors.ConfigError` that names ``field`` and
    lists the allowed values."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{field} must be one of {choices}, got {value!r}") from None


def check_agrees(options: object, given: Mapping[str, object]) -> None:
    """Raise unless every keyword in ``given`` equals the same field of ``options``.

    Args:
        given: the keywords the caller set away from their defaults, normalized (enums, not
            strings) and by field name. A keyword left at its default defers to ``options``.

    Raises:
        ConfigError: naming the keywords that disagree (never their values: one may be a key).
    """
    clash = sorted(name for name, value in given.items() if value != getattr(options, name))
    if clash:
        raise ConfigError(
            f"{', '.join(clash)} given both as keyword and in options={type(options).__name__}"
            "(...) with different values: give each setting once"
        )


def refuse_moved(owner: str, keywords: Mapping[str, Any], moved: Mapping[str, str]) -> None:
    """Raise for the first of ``keywords`` (what ``owner``'s ``**`` caught): a ConfigError
    naming where a keyword of an earlier layout went (``moved``: name -> its place now, where
    ``{name}`` stands for it), else a ``TypeError`` as Python's own.

    Raises:
        ConfigError: a keyword in ``moved``.
        TypeError: an unknown keyword.
    """
    for name in keywords:
        if name in moved:
            where = moved[name].format(name=name)
            raise ConfigError(f"{owner}({name}=) moved to {where} (docs/manager.md)")
        raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
