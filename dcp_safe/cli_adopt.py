"""``dcp-safe adopt SRC ROOT [NAME]``: :func:`dcp_safe.checkpoints.adopt.adopt` from the command
line (docs/adopt.md); its ``--json`` is the ``AdoptReport``. Torch is imported when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from dcp_safe.cli_output import EXIT_OK, add_subcommand, emit_json
from dcp_safe.errors import CheckpointNotFoundError
from dcp_safe.topology import Root


def add_adopt(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "adopt",
        common,
        help="commit a stock DCP checkpoint folder under a root (docs/adopt.md)",
        description="Checks a folder torch's FileSystemWriter wrote (its metadata decoded"
        " without running code, every file whole, every item read once and checksummed, every"
        " item decoded as a load would) and commits it under ROOT as NAME (default: the"
        " folder's name), copied or, with --in-place, where it is. DCP stores no checksums: a"
        " byte changed inside a tensor's data before adoption cannot be found.",
    )
    p.add_argument("source", help="the stock checkpoint folder: a directory or a URL")
    p.add_argument("root", help="checkpoint root to commit it under")
    p.add_argument("name", nargs="?", help="its name there (default: the folder's name)")
    p.add_argument(
        "--in-place",
        dest="where_it_is",
        action="store_true",
        help="commit the folder where it is (ROOT must be its parent) instead of a copy",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="adopt one whose objects need pickled classes: only a source you trust as code",
    )
    p.set_defaults(run=_adopt)


def _adopt(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    from dcp_safe.checkpoints.adopt import adopt

    try:
        report = adopt(
            Root(args.source, options),
            Root(args.root, options),
            args.name,
            copy=not args.where_it_is,
            allow_pickle=args.allow_pickle,
        )
    except CheckpointNotFoundError as exc:  # the source: 'dcp-safe ls ROOT' would not help
        raise FileNotFoundError(str(exc)) from None
    if args.json:
        emit_json(out, {**vars(report), "unchecked": list(report.unchecked)})
        return EXIT_OK
    how = "copied" if report.copied else "in place"
    out.print(
        f"adopted {report.name} ({how}): {report.files} files, {report.items} items, world"
        f" size {report.world_size}, committed at {report.path}",
        markup=False,
        highlight=False,
    )
    for line in report.unchecked:
        out.print(f"not checked: {line}", markup=False, highlight=False)
    return EXIT_OK
