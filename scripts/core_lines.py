"""Line counts of the core: every module of dcp_safe but testing/, bench/, demo/ and the CLI.

Prints the total lines and the code lines (neither blank, nor a comment, nor a docstring), per
part and overall, so a change's effect on the core's size is one command:
``python scripts/core_lines.py [PACKAGE_DIR]``.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

FACES = {
    "testing",
    "bench",
    "demo",
    "cli.py",
    "cli_adopt.py",
    "cli_args.py",
    "cli_manifests.py",
    "cli_output.py",
    "cli_schemas.py",
    "cli_tensors.py",
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            first = body[0] if body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if (
                first is not None
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines holding a token that is not a comment, outside docstrings."""
    skipped = _docstring_lines(ast.parse(source))
    lines: set[int] = set()
    ignored = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in ignored or token.type == tokenize.ENDMARKER:
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - skipped)


def main(package: Path) -> None:
    parts: dict[str, tuple[int, int]] = {}
    for path in sorted(package.rglob("*.py")):
        top = path.relative_to(package).parts[0]
        if top in FACES:
            continue
        source = path.read_text(encoding="utf-8")
        part = top if (package / top).is_dir() else "(foundation)"
        total, code = parts.get(part, (0, 0))
        parts[part] = (total + len(source.splitlines()), code + code_lines(source))
    for part, (total, code) in sorted(parts.items()):
        print(f"{part:16} {total:7,} {code:7,}")
    total = sum(t for t, _ in parts.values())
    code = sum(c for _, c in parts.values())
    print(f"{'core':16} {total:7,} {code:7,}   (lines, code lines)")


if __name__ == "__main__":
    main(
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "dcp_safe"
    )
