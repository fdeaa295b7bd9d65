"""Rendering quantities: one spelling of a byte count for messages, one for tables.

Messages (errors, ``explain()``) carry the exact figure, so a user can compare it with a limit
they set; tables and progress lines (benchmarks, the demo) carry only the rounded size, so their
columns stay narrow.
"""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """Render a byte count for messages, with the exact figure (``"3.00 GiB (3221225472 B)"``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit} ({n} B)"
    return f"{n} B"


def format_size(n: float) -> str:
    """Render a byte count for tables: ``"3.00 GiB"`` from 1 GiB up, else ``"12.5 MiB"``."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"
