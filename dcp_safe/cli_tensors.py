"""``dcp-safe inspect`` and ``export``: the verbs that decode DCP's metadata and tensors.

Both need torch, so both import what needs it when they run (``export``'s arguments, whose
choices come from the export module, only when ``export`` is the verb): the other verbs start
without torch (docs/cli.md, "Startup").
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dcp_safe import layout
from dcp_safe.checkpoints import catalog
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.cli_args import require_root
from dcp_safe.cli_output import EXIT_OK, add_subcommand, emit_json, metrics_text, size_text
from dcp_safe.topology import Root
from dcp_safe.untrusted import shown

# ----------------------------------------------------------------------------------- inspect


def add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(sub, "inspect", common, help="tensors and objects in a checkpoint")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("name", help=f"checkpoint name or {layout.LATEST!r}")
    p.set_defaults(run=_inspect)


def _inspect(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    from dcp_safe.adapters.reader import SafeStorageReader  # torch: only for this verb

    require_root(args.root)
    reader = SafeStorageReader(root := Root(args.root, options))
    reader.reset(catalog.latest_named(root, args.name))
    metadata = reader.read_metadata()
    name = reader.checkpoint_id or args.name
    manifest = open_committed(reader.backend, name).manifest
    stored = _stored_bytes(manifest.items)
    entries = [
        _entry(fqn, meta, stored.get(fqn, 0)) for fqn, meta in metadata.state_dict_metadata.items()
    ]
    entries.sort(key=lambda e: e["fqn"])
    totals = {
        "entries": len(entries),
        "tensors": sum(1 for e in entries if e["kind"] == "tensor"),
        "bytes": sum(e["bytes"] for e in entries),
        "stored_bytes": sum(e["stored_bytes"] for e in entries),
    }
    if args.json:
        metrics = None if manifest.metrics is None else dict(manifest.metrics)
        emit_json(out, {"name": name, "metrics": metrics, "entries": entries, "totals": totals})
        return EXIT_OK
    table = Table(title=Text(f"{name} under {shown(args.root)}"))  # text, not markup
    for column in ("FQN", "shape", "dtype", "bytes", "stored", "shards"):
        right = column in ("bytes", "stored", "shards")
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    for e in entries:
        shape = "-" if e["shape"] is None else "x".join(map(str, e["shape"])) or "()"
        table.add_row(
            Text(shown(e["fqn"])),  # .metadata's keys: storage's text ("w[/b]" is no markup)
            shape,
            e["dtype"],
            size_text(e["bytes"]),
            size_text(e["stored_bytes"]),
            str(e["shards"]),
        )
    out.print(table)
    out.print(
        f"{totals['entries']} entries ({totals['tensors']} tensors): {size_text(totals['bytes'])}"
        f" of tensor data, {size_text(totals['stored_bytes'])} stored",
        highlight=False,
    )
    if manifest.metrics:
        out.print(Text(f"metrics: {metrics_text(manifest.metrics)}"))
    return EXIT_OK


def _stored_bytes(items: Sequence[Any]) -> dict[str, int]:
    stored: dict[str, int] = {}
    for item in items:
        stored[item.fqn] = stored.get(item.fqn, 0) + item.length
    return stored


def _entry(fqn: str, meta: Any, stored: int) -> dict[str, Any]:
    chunks = getattr(meta, "chunks", None)
    if chunks is None:  # BytesStorageMetadata: a pickled object
        return {
            "fqn": fqn,
            "kind": "object",
            "shape": None,
            "dtype": "object",
            "bytes": 0,
            "stored_bytes": stored,
            "shards": 1,
        }
    dtype = meta.properties.dtype
    numel = 1
    for dim in meta.size:
        numel *= dim
    element = dtype.itemsize if hasattr(dtype, "itemsize") else 0
    return {
        "fqn": fqn,
        "kind": "tensor",
        "shape": list(meta.size),
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": numel * element,
        "stored_bytes": stored,
        "shards": len(chunks),
    }


# ------------------------------------------------------------------------------------ export


def add_export(sub: Any, common: argparse.ArgumentParser, *, full: bool) -> None:
    help_line = "write a checkpoint as safetensors or one torch file"
    if not full:  # listed in the help; its arguments (and torch) only when it runs
        add_subcommand(sub, "export", common, help=help_line, add_help=False)
        return
    from dcp_safe.exporting.api import ExportFormat
    from dcp_safe.exporting.formats import DEFAULT_MAX_SHARD_BYTES

    description = (
        f"Write a committed checkpoint as consolidated safetensors ({layout.SAFETENSORS_FILE},"
        f" or shards plus {layout.SAFETENSORS_INDEX} past --max-shard-bytes) or one torch.save"
        f" file ({layout.TORCH_FILE}), into the new directory DEST with a"
        f" {layout.EXPORT_CHECKSUMS}. Every byte is read through the verifying reader; tensors"
        " saved by several ranks are assembled whole; DEST appears complete or not at all."
        " Non-tensor entries are skipped for safetensors."
    )
    p = add_subcommand(sub, "export", common, help=help_line, description=description)
    p.add_argument("root", help="checkpoint root")
    p.add_argument("name", help=f"checkpoint name or {layout.LATEST!r}")
    p.add_argument("dest", help="directory to create (refused if it exists)")
    formats, default = [f.value for f in ExportFormat], ExportFormat.SAFETENSORS.value
    format_help = "output format (default safetensors)"
    p.add_argument("--format", choices=formats, default=default, help=format_help)
    keys = "export only these entries: full dotted keys or prefixes (default: all)"
    p.add_argument("--keys", nargs="+", metavar="K", help=keys)
    p.add_argument("--dtype", help="cast floating tensors, e.g. bfloat16")
    shard = f"most bytes per safetensors file (default {DEFAULT_MAX_SHARD_BYTES})"
    p.add_argument(
        "--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES, metavar="N", help=shard
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export at DEST atomically"
    )
    p.set_defaults(run=_export)


def _export(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    from dcp_safe.exporting.api import export

    require_root(args.root)
    root = Root(args.root, options)
    result = export(
        root,
        catalog.latest_named(root, args.name),  # warns of damage
        args.dest,
        format=args.format,
        keys=args.keys,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        overwrite=args.overwrite,
    )
    if args.json:
        emit_json(
            out,
            {
                "name": result.checkpoint,
                "dest": result.dest,
                "format": result.format.value,
                "files": list(result.files),
                "tensors": result.tensors,
                "tensor_bytes": result.tensor_bytes,
                "objects": result.objects,
                "skipped": dict(result.skipped),
            },
        )
        return EXIT_OK
    for line in result.summary():
        out.print(line, markup=False, highlight=False)
    return EXIT_OK
