"""Text from storage is shown escaped: nothing in it can drive a terminal or forge a line."""

from __future__ import annotations

import re

import pytest

from dcp_safe.untrusted import shown

# Everything a terminal or a log viewer acts on (C0, DEL, C1, separators, bidi, zero width).
_ACTIVE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200b-\u200f]")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("step_000000001", "step_000000001"),
        ("évite/日本/ü", "évite/日本/ü"),
        ("a\\x1b stays as typed", "a\\x1b stays as typed"),
        ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
        ("line\nforged\rline\t", "line\\nforged\\rline\\t"),
        ("csi\x9b31m", "csi\\x9b31m"),
        ("gpj.\u202eexe", "gpj.\\u202eexe"),
        ("sep\u2028x", "sep\\u2028x"),
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
        ("bad byte \udcff", "bad byte \\udcff"),
    ],
)
def test_control_bidi_and_separator_characters_are_escaped(raw: str, expected: str) -> None:
    assert shown(raw) == expected


def test_bytes_and_objects_are_shown_as_text() -> None:
    assert shown(b"\xff\x1bx") == "\\udcff\\x1bx"
    assert shown(ValueError("bad\nname")) == "bad\\nname"
    assert shown(None) == "None"


def test_long_text_is_cut_with_a_note_of_what_was_cut() -> None:
    text = shown("x" * 5000, 100)
    assert text == "x" * 100 + "...(+4900 chars)"


def test_escaping_twice_changes_nothing() -> None:
    raw = "".join(chr(c) for c in range(0x00, 0xA0)) + "\u202e\u2028\udc80"
    once = shown(raw, 10_000)
    assert shown(once, 10_000) == once
    assert not _ACTIVE.search(once)
