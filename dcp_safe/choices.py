"""Options spelled as strings: parsing a ``str`` enum once, with one error for a bad value.

Modes are ``str`` enums (``when_busy="skip"``, ``compression="zstd"``), so users may pass the
enum or its value; every component parses them here, so every bad value reads alike.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from dcp_safe.errors import ConfigError

__all__ = ["parse_choice"]

E = TypeVar("E", bound=enum.Enum)


def parse_choice(kind: type[E], value: object, field: str) -> E:
    """``kind(value)``, or a :class:`~dcp_safe.errors.ConfigError` that lists the allowed values.

    Args:
        kind: the enum.
        value: the member or its value.
        field: the option's name, for the message.
    """
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{field} must be one of {choices}, got {value!r}") from None
