"""Strict parsing of control files: the size caps, the JSON reader and the field checks.

Every control file may have been written by anyone who can write the root, so each is read whole
only as a regular file under its cap, parsed by :func:`parse_json`, and checked field by field;
each failure is a :class:`~dcp_safe.errors.CheckpointCorruptError` naming the file, so a caller
choosing among checkpoints skips one bad entry and keeps the rest (docs/integrity.md, "Hostile
storage"). A size cap does not bound a parse (``[[],[],...]`` costs 25-30 times its size), so
:func:`parse_json` first bounds what the parse would allocate from counts of the structural
bytes (:func:`parse_cost`) and refuses a document over :data:`PARSE_BUDGET_BYTES` unparsed;
dcp_safe's own documents cost about 11 bytes of estimate per byte. Streaming the parse instead
would need a second JSON parser to trust.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dcp_safe.errors import CheckpointCorruptError

#: Markers (``_COMMITTED``, ``_NODE_COMMITTED``) and writing leases.
CONTROL_MAX_BYTES = 1 << 20
#: ``manifest.json``, rank manifests and ``.metadata``: about a million items' worth.
MANIFEST_MAX_BYTES = 256 << 20
#: ``_history.jsonl``: only its newest part this size is read (the rest is dropped on rewrite).
HISTORY_MAX_BYTES = 16 << 20
#: Integers in control files (sizes, offsets, steps, ranks) fit a signed 64-bit integer.
MAX_INT = (1 << 63) - 1
#: Times are seconds since the epoch up to the end of year 9999 (what ``datetime`` can show).
MAX_TIMESTAMP = 253_402_300_799.0
#: Strings in control files (names, ids, fqns, checksums, versions), in characters.
MAX_STR = 1 << 16
#: The most pieces a tensor's chunk boundaries may cut it into for an exact tiling check
#: (8 bytes a piece; DCP's row and grid shardings make one piece per chunk).
TILE_MAX_CELLS = 1 << 22
#: What parsing one JSON document may cost, as :func:`parse_cost` estimates it (an upper bound).
PARSE_BUDGET_BYTES = 1 << 30

# Bytes of Python objects a parse allocates at most per structural byte of the document
# (CPython 3.11, 64-bit; ``tests/manifest/test_limits.py`` checks each is an upper bound): a list
# with its first element, a dict with its first key table and value, a further dict entry, a
# further element (a number, or a slot), a string's object header (per quote, two a string).
_COSTS = {b"[": 112, b"{": 200, b":": 64, b",": 40, b'"': 32}
# The parser's own fixed allocations (its scanner, the memo of keys, object headers).
_COST_BASE = 1 << 16


def _finite_float(text: str) -> float:
    """A JSON float, or constant (``NaN``, ``Infinity``, ``-Infinity``), if it is finite."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a number a control file may hold")
    return value


def parse_cost(data: bytes) -> int:
    """An upper bound on the bytes ``json.loads(data)`` allocates, from counts of its bytes.

    The text itself is decoded into one ``str`` (4 bytes a character unless it is ASCII without
    ``\\u`` escapes) and strings hold at most that much; every other object is announced by a
    structural byte (``[``, ``{``, ``:``, ``,``, ``"``), each counted at its largest cost.
    """
    plain = data.isascii() and b"\\u" not in data
    text = len(data) * (2 if plain else 8)  # the decoded text, and the strings cut from it
    return _COST_BASE + text + sum(cost * data.count(byte) for byte, cost in _COSTS.items())


def parse_json(data: bytes, path: str) -> Any:
    """The JSON document in ``data`` (from ``path``), strictly; one whose :func:`parse_cost`
    is over :data:`PARSE_BUDGET_BYTES` is refused unparsed.

    Raises:
        CheckpointCorruptError: not UTF-8 JSON; NaN, an infinity or a float out of range; an
            integer past Python's digit limit; nesting too deep to parse; over the budget.
    """
    cost = parse_cost(data)
    if cost > PARSE_BUDGET_BYTES:
        raise CheckpointCorruptError(
            path,
            f"{len(data)} bytes of JSON whose parse could take {cost} bytes of memory,"
            f" over the {PARSE_BUDGET_BYTES}-byte budget",
        )
    try:
        return json.loads(data, parse_constant=_finite_float, parse_float=_finite_float)
    except RecursionError:
        raise CheckpointCorruptError(path, "not valid JSON (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointCorruptError(path, f"not valid JSON ({str(exc)[:200]})") from None


def require_int(field: str, value: object, *, minimum: int = 0, what: str = "an integer") -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, MAX_INT]``, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise ValueError(f"{field} must be {what} in [{minimum}, {MAX_INT}], got {_show(value)}")
    return value


def require_timestamp(field: str, value: object) -> float:
    """``value`` if it is a finite number of seconds in ``[0, MAX_TIMESTAMP]``, else ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value <= MAX_TIMESTAMP  # NaN fails this too
    ):
        raise ValueError(f"{field} must be a time in seconds since the epoch, got {_show(value)}")
    return float(value)


def require_str(field: str, value: object, *, max_length: int = MAX_STR) -> str:
    """``value`` if it is a str of at most ``max_length`` characters, else ValueError."""
    if not isinstance(value, str) or len(value) > max_length:
        raise ValueError(f"{field} must be a string of at most {max_length} characters")
    return value


def require_keys(
    what: str, raw: object, allowed: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``raw`` if it is a JSON object of the ``allowed`` keys (each but ``optional`` present),
    else ValueError naming a few of the missing and unknown keys."""
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be an object, got {type(raw).__name__}")
    missing, unknown = sorted(allowed - optional - raw.keys()), sorted(raw.keys() - allowed)[:5]
    if missing or unknown:
        raise ValueError(f"{what}: missing {missing}, unknown {[k[:40] for k in unknown]}")
    return raw


def require_list(what: str, value: object, *, at_most: int = MAX_INT) -> list[Any]:
    """``value`` if it is a JSON list of at most ``at_most`` elements, else ValueError."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    if len(value) > at_most:
        raise ValueError(f"{what} has {len(value)} elements, more than {at_most}")
    return value


def _show(value: object) -> str:
    """A short description of a rejected value (never its whole text)."""
    if isinstance(value, (bool, float)) or (isinstance(value, int) and abs(value) < 10**30):
        return repr(value)
    text = repr(value) if isinstance(value, str) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."
