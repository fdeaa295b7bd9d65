"""``dcp-safe history``, ``show``, ``diff`` and ``replicate``: a root's record, read from its
history file and its manifests (no checkpoint data is read, but by ``replicate``).

``history`` and ``show`` import no torch (docs/cli.md, "Startup"): the manifest is plain JSON
and DCP's metadata in it (:mod:`dcp_safe.manifest.dcp_metadata`'s plain form) is read here as
untrusted values, only to be shown. ``diff`` compares two manifests' per-item checksums.
``replicate`` is :func:`~dcp_safe.replication.replicator.replicate_checkpoint`, the copy the
manager's replication runs: every byte checked as it streams, committed at the destination.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints import catalog
from dcp_safe.checkpoints.committed import CommittedCheckpoint, open_committed, resolve_name
from dcp_safe.checkpoints.history import History
from dcp_safe.cli_args import require_root
from dcp_safe.cli_output import (
    EXIT_OK,
    add_subcommand,
    emit_json,
    metrics_text,
    print_columns,
    size_text,
    when_text,
)
from dcp_safe.manifest.schema import ItemRecord, Manifest
from dcp_safe.manifest.signing import MAX_SIGNATURE_BYTES
from dcp_safe.topology import Root
from dcp_safe.untrusted import shown

# The fields every history event has in ``--json`` (null where the line has none); the rest of
# a line, if any, is under "fields".
_EVENT_KEYS = ("event", "time", "step", "name", "tier", "reason", "validated")


def _opened(
    args: argparse.Namespace, options: dict[str, Any] | None, name: str
) -> tuple[Backend, CommittedCheckpoint]:
    require_root(args.root)
    root = Root(args.root, options)
    backend = open_backend(root)
    return backend, open_committed(backend, resolve_name(backend, catalog.latest_named(root, name)))


# ----------------------------------------------------------------------------------- history


def add_history(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "history",
        common,
        help="the root's event log: saves requested, committed, skipped, failed, pruned...",
        description=f"The manager's record of the root ({layout.HISTORY_FILE}), oldest first:"
        " each event with its time, step, checkpoint name, tier and reason. A damaged line is"
        " passed by with a warning on stderr.",
    )
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--event", action="append", metavar="E", help="only these events (repeat)")
    p.add_argument("--name", help="only the events of this checkpoint")
    p.add_argument("--last", type=int, metavar="N", help="only the newest N (after filtering)")
    p.set_defaults(run=_history)


def _history(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    require_root(args.root)
    events = [
        _event_json(e)
        for e in History(open_backend(Root(args.root, options))).read()
        if (args.event is None or e["event"] in args.event)
        and (args.name is None or e["name"] == args.name)
    ]
    if args.last is not None:
        events = events[-args.last :] if args.last > 0 else []
    if args.json:
        emit_json(out, {"root": args.root, "events": events})
        return EXIT_OK
    print_columns(
        out,
        f"history of {args.root}",
        ("time (UTC)", "event", "step", "name", "tier", "reason"),
        [
            (
                when_text(e["time"]),
                e["event"],
                "-" if e["step"] is None else str(e["step"]),
                e["name"] or "-",
                e["tier"] or "-",
                e["reason"] or metrics_text(e["fields"].get("metrics")),
            )
            for e in events
        ],
        right={2},
    )
    if not events:
        out.print("no events recorded", highlight=False)
    return EXIT_OK


def _event_json(event: Mapping[str, Any]) -> dict[str, Any]:
    doc = {key: event.get(key) for key in _EVENT_KEYS}
    doc["fields"] = {k: v for k, v in event.items() if k not in _EVENT_KEYS}
    return doc


# -------------------------------------------------------------------------------------- show


def add_show(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "show",
        common,
        help="a checkpoint's manifest: world size, keys, sizes, signature, format",
        description="What the manifest says, without reading the data: who wrote it, when,"
        " for what world size, in which format, whether it carries a signature, and every key"
        " with its stored size (and, for DCP's, its dtype and shape).",
    )
    p.add_argument("root", help="checkpoint root")
    p.add_argument(
        "name", nargs="?", default=layout.LATEST, help=f"checkpoint name or {layout.LATEST!r}"
    )
    p.set_defaults(run=_show)


def _show(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    backend, opened = _opened(args, options, args.name)
    doc = _summary(backend, opened)
    if args.json:
        emit_json(out, doc)
        return EXIT_OK
    for label, key in (
        ("name", "name"),
        ("step", "step"),
        ("created (UTC)", "created_at"),
        ("world size", "world_size"),
        ("format", "format"),
        ("written by", "dcp_safe_version"),
        ("torch", "torch_version"),
        ("checksums", "checksum_algorithm"),
        ("signature", "signature"),
        ("save id", "save_id"),
        ("digest", "digest"),
        ("metrics", "metrics"),
    ):
        value = doc[key]
        text = when_text(value) if key == "created_at" else "-" if value is None else str(value)
        text = (metrics_text(value) or "-") if key == "metrics" else text
        out.print(Text(f"{label:14} {shown(text)}"))
    out.print(
        f"{'size':14} {size_text(doc['total_bytes'])} in {doc['files']} file(s),"
        f" {doc['items']} item(s)",
        highlight=False,
    )
    table = Table(title="keys")
    for column in ("key", "kind", "dtype", "shape", "items", "stored"):
        table.add_column(column, overflow="fold")
    for k in doc["keys"]:
        shape = "-" if k["shape"] is None else "x".join(map(str, k["shape"])) or "()"
        table.add_row(
            Text(shown(k["key"])),
            k["kind"] or "-",
            Text(shown(k["dtype"] or "-")),
            shape,
            str(k["items"]),
            size_text(k["stored_bytes"]),
        )
    out.print(table)
    return EXIT_OK


def _summary(backend: Backend, opened: CommittedCheckpoint) -> dict[str, Any]:
    manifest = opened.manifest
    declared = _declared(manifest)
    keys: dict[str, dict[str, Any]] = {}
    for item in manifest.items:
        kind, dtype, shape = declared.get(item.fqn, (None, None, None))
        entry = keys.setdefault(
            item.fqn,
            {
                "key": item.fqn,
                "kind": kind,
                "dtype": dtype,
                "shape": shape,
                "items": 0,
                "stored_bytes": 0,
            },
        )
        entry["items"] += 1
        entry["stored_bytes"] += item.length
    return {
        "name": opened.name,
        "path": backend.full_path(opened.name),
        "step": manifest.step,
        "save_id": manifest.save_id,
        "created_at": manifest.created_at,
        "world_size": manifest.world_size,
        "format": manifest.data_format or "dcp",
        "manifest_version": manifest.version,
        "dcp_safe_version": manifest.dcp_safe_version,
        "torch_version": manifest.torch_version,
        "checksum_algorithm": manifest.checksum_algorithm,
        "compression": manifest.compression,
        "attempt": manifest.attempt,
        "signature": _signature(backend, opened.name),
        "digest": opened.digest,
        "metrics": None if manifest.metrics is None else dict(manifest.metrics),
        "total_bytes": manifest.total_bytes,
        "files": len(manifest.files),
        "items": len(manifest.items),
        "keys": sorted(keys.values(), key=lambda k: k["key"]),
    }


def _declared(manifest: Manifest) -> dict[str, tuple[str, str | None, list[int] | None]]:
    """Kind, dtype and shape per key from DCP's metadata in the manifest, where its plain form
    says so; anything else in it is passed by (shown, never trusted: loads decode it strictly)."""
    found: dict[str, tuple[str, str | None, list[int] | None]] = {}
    entries = (manifest.dcp_metadata or {}).get("entries")
    for entry in entries if isinstance(entries, list) else []:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            continue
        key, meta = entry
        if meta is None:
            found[key] = ("object", None, None)
        elif isinstance(meta, dict):
            dtype, size = meta.get("dtype"), meta.get("size")
            plain = isinstance(size, list) and all(type(n) is int for n in size)
            found[key] = (
                "tensor",
                dtype if isinstance(dtype, str) else None,
                size if plain else None,
            )
    return found


def _signature(backend: Backend, name: str) -> str | None:
    """The algorithm a ``_SIGNATURE`` names (not checked: ``verify --signing-key-file`` does),
    or None when the checkpoint carries none."""
    try:
        raw = backend.read_small(f"{name}/{layout.SIGNATURE}", MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        return None
    return shown(raw.decode("ascii", "replace").partition(":")[0].strip(), 40)


# -------------------------------------------------------------------------------------- diff


def add_diff(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "diff",
        common,
        help="keys and tensors that differ between two checkpoints, by their checksums",
        description="Compares the manifests of A and B item by item (a key's shards by offset,"
        " each by its checksum), reading no data. A key whose items cannot be compared this"
        " way (saved on another sharding, with other checksums or transforms) is reported as"
        " incomparable. Exit status 0 whether or not they differ: read 'same' (--json).",
    )
    p.add_argument("root", help="checkpoint root")
    p.add_argument("a", metavar="A", help=f"checkpoint name or {layout.LATEST!r}")
    p.add_argument("b", metavar="B", help=f"checkpoint name or {layout.LATEST!r}")
    p.set_defaults(run=_diff)


def _diff(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    _, a = _opened(args, options, args.a)
    _, b = _opened(args, options, args.b)
    doc = _compare(a, b)
    if args.json:
        emit_json(out, doc)
        return EXIT_OK
    for label in ("added", "removed", "changed"):
        for key in doc[label]:
            out.print(Text(f"{label:8} {shown(key)}"))
    for entry in doc["incomparable"]:
        out.print(Text(f"{'unknown':8} {shown(entry['key'])}: {entry['reason']}"))
    verdict = "same" if doc["same"] else "differ"
    out.print(
        f"{shown(a.name)} and {shown(b.name)} {verdict}: {doc['unchanged']} key(s) unchanged,"
        f" {len(doc['changed'])} changed, {len(doc['added'])} added, {len(doc['removed'])}"
        f" removed, {len(doc['incomparable'])} incomparable",
        highlight=False,
    )
    return EXIT_OK


def _compare(a: CommittedCheckpoint, b: CommittedCheckpoint) -> dict[str, Any]:
    left, right = _by_key(a.manifest), _by_key(b.manifest)
    changed: list[str] = []
    incomparable: list[dict[str, str]] = []
    for key in sorted(left.keys() & right.keys()):
        why = _incomparable(left[key], right[key])
        if why is not None:
            incomparable.append({"key": key, "reason": why})
        elif any(left[key][o].checksum != right[key][o].checksum for o in left[key]):
            changed.append(key)
    added, removed = sorted(right.keys() - left.keys()), sorted(left.keys() - right.keys())
    return {
        "a": a.name,
        "b": b.name,
        "same": not (added or removed or changed or incomparable),
        "added": added,
        "removed": removed,
        "changed": changed,
        "incomparable": incomparable,
        "unchanged": len(left.keys() & right.keys()) - len(changed) - len(incomparable),
    }


def _by_key(manifest: Manifest) -> dict[str, dict[tuple[int, ...] | None, ItemRecord]]:
    keys: dict[str, dict[tuple[int, ...] | None, ItemRecord]] = {}
    for item in manifest.items:
        keys.setdefault(item.fqn, {})[item.offset] = item
    return keys


def _incomparable(
    a: Mapping[tuple[int, ...] | None, ItemRecord], b: Mapping[tuple[int, ...] | None, ItemRecord]
) -> str | None:
    if a.keys() != b.keys():
        return "saved in other shards (another world size or sharding); compare the data"
    for offset, item in a.items():
        other = b[offset]
        if item.checksum.partition(":")[0] != other.checksum.partition(":")[0]:
            return "checksums of different algorithms"
        if item.transforms != other.transforms:
            return "stored with different transforms (compression)"
    return None


# --------------------------------------------------------------------------------- replicate


def add_replicate(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "replicate",
        common,
        help="copy one committed checkpoint to another root, verified, and commit it there",
        description="The copy the manager's replication makes: every file streamed to DEST and"
        " checked against its checksum on the way, then committed at DEST (its marker written"
        " last). Idempotent: nothing is copied when DEST holds NAME committed with the same"
        " manifest; refused (exit 4) when it holds NAME with another. Then DEST's copy is"
        " checked (--quick: marker, manifest and sizes, the default; --deep: every byte read"
        " back).",
    )
    p.add_argument("root", help="source checkpoint root")
    p.add_argument("name", help=f"checkpoint name or {layout.LATEST!r}")
    p.add_argument("remote", metavar="DEST", help="destination root: a directory or a URL")
    p.add_argument("--deep", action="store_true", help="read every copied byte back from DEST")
    p.set_defaults(run=_replicate)


def _replicate(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    from dcp_safe.replication.replicator import replicate_checkpoint

    source, opened = _opened(args, options, args.name)
    dest = open_backend(Root(args.remote, options))
    manifest = replicate_checkpoint(source, dest, opened.name)
    report = catalog.verify_opened(dest, open_committed(dest, opened.name), deep=args.deep)
    doc: dict[str, Any] = {
        "name": opened.name,
        "source": source.full_path(opened.name),
        "dest": dest.full_path(opened.name),
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        "verified": "deep" if args.deep else "quick",
        "seconds": report.seconds,
    }
    if args.json:
        emit_json(out, doc)
        return EXIT_OK
    out.print(
        Text(
            f"replicated {shown(opened.name)} to {shown(doc['dest'])}: {doc['files']} file(s),"
            f" {size_text(doc['bytes'])}; committed there and checked ({doc['verified']})"
        )
    )
    return EXIT_OK
