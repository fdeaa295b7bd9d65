"""The fenced code blocks of the docs, and which of them run (tests/e2e/test_docs.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = frozenset({"python", "bash"})
# Blocks that show something rather than do it: output, a file's contents, a formula.
SHOWN = frozenset({"text", "json"})
# On the line before a block (blank lines between allowed): the block is not run, and why.
NOT_RUN = re.compile(r"^<!--\s*not run:\s*\S.*-->\s*$")

_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`\n]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block.

    Attributes:
        language: the info string's first word (``python``, ``bash``, ``text``), or empty.
        marked: preceded by a ``<!-- not run: why -->`` comment.
    """

    path: Path
    line: int
    language: str
    code: str
    marked: bool = False

    @property
    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        return f"{path}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUN and not self.marked

    @property
    def accounted_for(self) -> bool:
        """Run, shown (text, json) or marked as not run: anything else is a block nobody
        decided about."""
        return self.language in RUN | SHOWN or self.marked


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, in order."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        fence, info = opened["fence"], opened["info"].strip()
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        start = i + 1
        i = start
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        language = info.split()[0].lower() if info else ""
        code = "\n".join(lines[start:i]) + "\n"
        blocks.append(Block(path, start + 1, language, code, bool(NOT_RUN.match(before))))
        i += 1
    return blocks


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
