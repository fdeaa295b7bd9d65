"""Rendering quantities for messages: one spelling of a byte count everywhere."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int) -> str:
    """Render a byte count for messages, with the exact figure (``"3.00 GiB (3221225472 B)"``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit} ({n} B)"
    return f"{n} B"
