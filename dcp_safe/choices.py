"""Options spelled as strings: parsing a ``str`` enum once, with one error for a bad value.

Modes are ``str`` enums (``when_busy="skip"``, ``compression="zstd"``), so users may pass the
enum or its value; every component parses them here, so every bad value reads alike.
"""

from __future__ import annotations

import enum
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


def refuse_moved(owner: str, keywords: Mapping[str, Any], moved: Mapping[str, str]) -> None:
    """Raise for the first of ``keywords`` (what ``owner``'s ``**`` caught): a ConfigError
    naming where a keyword of an earlier layout went (``moved``: name -> its place now, where
    ``{name}`` stands for it), else a ``TypeError`` as Python's own."""
    for name in keywords:
        if name in moved:
            where = moved[name].format(name=name)
            raise ConfigError(f"{owner}({name}=) moved to {where} (docs/manager.md)")
        raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
