"""``dcp-safe export``'s arguments and its call, so that ``cli.py`` only wires the verb in.

Bad values surface as :class:`~dcp_safe.errors.ConfigError` from the library (exit status 2).
"""

from __future__ import annotations

import argparse

from dcp_safe import layout
from dcp_safe.checkpoints.catalog import latest_named
from dcp_safe.exporting.api import ExportFormat, ExportResult, export
from dcp_safe.exporting.formats import DEFAULT_MAX_SHARD_BYTES
from dcp_safe.topology import Root

DESCRIPTION = (
    f"Write a committed checkpoint as consolidated safetensors ({layout.SAFETENSORS_FILE}, or"
    f" shards plus {layout.SAFETENSORS_INDEX} past --max-shard-bytes) or one torch.save file"
    f" ({layout.TORCH_FILE}), into the new directory DEST with a {layout.EXPORT_CHECKSUMS}."
    " Every byte is read through the verifying reader; tensors saved by several ranks are"
    " assembled whole; DEST appears complete or not at all. Non-tensor entries are skipped for"
    " safetensors."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the export verb's arguments to ``parser`` (its subcommand parser)."""
    parser.add_argument("root", help="checkpoint root")
    parser.add_argument("name", help=f"checkpoint name or {layout.LATEST!r}")
    parser.add_argument("dest", help="directory to create (refused if it exists)")
    formats, default = [f.value for f in ExportFormat], ExportFormat.SAFETENSORS.value
    format_help = "output format (default safetensors)"
    parser.add_argument("--format", choices=formats, default=default, help=format_help)
    keys = "export only these entries: full dotted keys or prefixes (default: all)"
    parser.add_argument("--keys", nargs="+", metavar="K", help=keys)
    parser.add_argument("--dtype", help="cast floating tensors, e.g. bfloat16")
    shard = f"most bytes per safetensors file (default {DEFAULT_MAX_SHARD_BYTES})"
    parser.add_argument(
        "--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES, metavar="N", help=shard
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export at DEST atomically"
    )


def run(args: argparse.Namespace, root: Root) -> ExportResult:
    """The export ``args`` ask for, from ``root`` (``args.root`` with its options)."""
    return export(
        root,
        latest_named(root, args.name),  # warns of damage
        args.dest,
        format=args.format,
        keys=args.keys,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        overwrite=args.overwrite,
    )
