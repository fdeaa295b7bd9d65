"""Text from storage, made safe to show: one helper for every message, log line and CLI line.

Anyone who can write a root chooses names and control-file bytes that reach messages, logs and
the terminal (docs/integrity.md, "Hostile storage"). Printed raw, an escape sequence retitles or
clears the terminal, a line separator forges a line of output, a right-to-left override shows
``gpj.exe`` as ``exe.jpg``. :func:`shown` writes every such character as its Python escape and
cuts the text to a bound, so a 1 MiB "save id" never floods a log.

Why escapes rather than dropping the characters or quoting the whole text with ``repr``: an
escape keeps what was there visible (an operator sees that a name holds ``\\x1b``), and text
that needs none comes out unchanged, so a message about an ordinary path reads as before.
Backslashes are left as they are, which makes :func:`shown` idempotent: text escaped at the
error that carries it and again where the CLI prints it is escaped once.
"""

from __future__ import annotations

import re

#: The default bound on the characters :func:`shown` returns (before its escapes).
MAX_SHOWN_CHARS = 1000

# C0 controls, DEL and C1 controls; the Unicode line and paragraph separators; the bidi
# embeddings, overrides and isolates and the directional marks; zero-width characters and the
# BOM; lone surrogates (undecodable bytes of a file name, which a UTF-8 terminal cannot print).
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]"
)


def shown(text: object, max_chars: int = MAX_SHOWN_CHARS) -> str:
    """``text`` (``str()`` of it; bytes decoded as UTF-8, undecodable bytes escaped) with
    every control, bidi and separator character escaped, cut to ``max_chars`` characters.

    The rest past ``max_chars`` is replaced by a note of how many were cut. Nothing in the
    result moves a cursor, starts a new line or reorders what follows.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="surrogateescape")
    value = text if isinstance(text, str) else str(text)
    if len(value) > max_chars:
        value = f"{value[:max_chars]}...(+{len(value) - max_chars} chars)"
    # Python's own escape of a character it would not print: ``\n``, ``\x1b``, ``\u202e``.
    return _UNSAFE.sub(lambda match: repr(match.group())[1:-1], value)
