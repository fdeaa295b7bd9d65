"""What ``dcp-safe`` prints besides a command's own output: exit codes, errors, JSON, warnings.

One table of exit codes (:data:`EXIT_CODES`, also in ``--help`` and docs/cli.md), one mapping
from an exception to its code and its hint (:func:`failure`), and one way to print a JSON
document (:func:`emit_json`), so every subcommand reports alike in text and in ``--json`` mode.
Imports neither torch nor the library's heavier parts: ``ls``, ``history`` and ``show`` start
fast (docs/cli.md, "Startup").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from rich.console import Console

from dcp_safe.cli_args import UsageError
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    DcpSafeError,
)
from dcp_safe.untrusted import shown

EXIT_OK = 0
EXIT_FAILED = 1  # damaged: a checkpoint does not check out
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_EXISTS = 4
EXIT_ERROR = 5

#: (code, name, when): the CLI's promise to scripts, printed by ``--help`` and docs/cli.md.
EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (EXIT_OK, "ok", "done; a checkpoint checked out sound"),
    (EXIT_FAILED, "damaged", "a checkpoint is corrupt, unsafe to load or not signed as required"),
    (EXIT_USAGE, "usage", "bad arguments or option values (argparse's errors, ConfigError)"),
    (EXIT_NOT_FOUND, "not_found", "no such root directory, checkpoint or file"),
    (EXIT_EXISTS, "exists", "the destination already holds something else"),
    (EXIT_ERROR, "error", "the operation failed: storage, credentials, a commit, a feature"),
)


class Unavailable(Exception):
    """A part of dcp_safe this installation lacks."""


def exit_codes_text() -> str:
    """The table as ``--help``'s epilog shows it."""
    rows = "\n".join(f"  {code}  {name:10} {when}" for code, name, when in EXIT_CODES)
    return f"exit status:\n{rows}"


def add_subcommand(sub: Any, name: str, common: argparse.ArgumentParser, **kw: Any) -> Any:
    """A subcommand's parser taking ``common``'s options, the exit codes its epilog."""
    return sub.add_parser(
        name,
        parents=[common],
        epilog=exit_codes_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )


def failure(exc: BaseException, root: str) -> tuple[int, str] | None:
    """The exit code and the one-line message (with its hint) for an expected error; None for
    one the CLI does not expect (a bug: its traceback is wanted)."""
    message = str(exc)
    if isinstance(exc, UsageError):
        return EXIT_USAGE, message
    if isinstance(exc, CheckpointNotFoundError):
        return EXIT_NOT_FOUND, f"{message}; run 'dcp-safe ls {root}' to see what is committed"
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND, message
    if isinstance(exc, CheckpointCorruptError):
        return EXIT_FAILED, f"CORRUPT: {message}"
    if isinstance(exc, ConfigError):  # the library's message says which value and what to do
        return EXIT_USAGE, message
    if isinstance(exc, CheckpointExistsError | FileExistsError):
        return EXIT_EXISTS, f"{type(exc).__name__}: {message}"
    if isinstance(exc, DcpSafeError | OSError | Unavailable):
        return EXIT_ERROR, f"{type(exc).__name__}: {message}"
    return None


def fail(err: Console, message: str, status: int) -> int:
    err.print(f"dcp-safe: error: {shown(message, 4000)}", markup=False, highlight=False)
    return status


def fail_json(out: Console, exc: BaseException | None, message: str, status: int) -> int:
    """An error as ``--json`` reports it: ``{"error", "message", "exit_code"}`` on stdout."""
    kind = "UsageError" if exc is None else type(exc).__name__
    doc = {"error": kind, "message": shown(message, 4000), "exit_code": status}
    emit_json(out, doc)
    return status


def emit_json(out: Console, doc: Any) -> None:
    """One JSON document on stdout (ASCII; storage's text escaped, never interpreted)."""
    out.file.write(json.dumps(doc, ensure_ascii=True, indent=2) + "\n")
    out.file.flush()


def print_columns(
    out: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Collection[int] = (),
) -> None:
    """A plain table, columns aligned (``right``: the indices of right-aligned ones), written
    at once: rich's Table costs about a millisecond a row, too slow for ``ls`` of hundreds.
    Every cell is made printable here (storage's text: a control character never reaches the
    terminal, and nothing is read as markup)."""
    cells = [[shown(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [shown(title)] + [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]
    out.file.write("\n".join(lines) + "\n")
    out.file.flush()


class _WarningLines(logging.Handler):
    """The library's logged warnings, printed as the CLI's own ``dcp-safe: warning:`` lines."""

    def __init__(self, err: Console) -> None:
        super().__init__(logging.WARNING)
        self._err = err

    def emit(self, record: logging.LogRecord) -> None:
        message = shown(" ".join(record.getMessage().split()))
        self._err.print(f"dcp-safe: warning: {message}", markup=False, highlight=False)


@contextlib.contextmanager
def library_warnings(err: Console) -> Iterator[None]:
    """While a command runs, dcp_safe's warnings (a damaged entry that ``gc`` or ``ls`` skips,
    a torn history line) reach stderr in the CLI's form, one line each, instead of through
    logging's bare last-resort handler."""
    logger = logging.getLogger("dcp_safe")
    handler, propagate = _WarningLines(err), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def metrics_text(metrics: Mapping[str, float | str] | None) -> str:
    """A save's metrics as ``val_loss=0.25, config=ab12`` ("": none), escaped: storage's."""
    items = (metrics or {}).items()
    return shown(", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in items))


def when_text(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")
