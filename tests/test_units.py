"""dcp_safe.units: the two spellings of a byte count, for messages and for tables."""

from __future__ import annotations

from dcp_safe.units import format_bytes, format_size


def test_a_message_carries_the_exact_figure() -> None:
    assert format_bytes(3 << 30) == "3.00 GiB (3221225472 B)"
    assert format_bytes(512) == "512 B"


def test_a_table_carries_the_rounded_size_in_mib_below_a_gib() -> None:
    assert format_size(3 << 30) == "3.00 GiB"
    assert format_size((1 << 30) - (1 << 20)) == "1023.0 MiB"
    assert format_size(1536 * 1024) == "1.5 MiB"
    assert format_size(-(2 << 30)) == "-2.00 GiB"
