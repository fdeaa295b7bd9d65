"""``dcp-safe``: list, verify, inspect, export and collect checkpoints; run the demo and bench.

This module parses arguments, calls the library, and prints; the work is done by
:mod:`dcp_safe.checkpoints.catalog`, :mod:`dcp_safe.retention`, :mod:`dcp_safe.adapters`,
:mod:`dcp_safe.exporting` and :mod:`dcp_safe.demo`. Tables and progress bars are rich's.

Exit status: 0 success; 1 a checkpoint is corrupt or a check or operation failed; 2 a usage
error (bad arguments, no such root or checkpoint), always with one line saying what to do.
Expected errors (the :class:`~dcp_safe.errors.DcpSafeError` tree) print that one line, never a
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from dcp_safe import layout
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints import catalog
from dcp_safe.checkpoints.catalog import CheckpointInfo, list_checkpoints, verify_checkpoint
from dcp_safe.checkpoints.committed import open_committed, recency, resolve_name
from dcp_safe.cli_args import (
    OneLineParser,
    UsageError,
    check_roots,
    key_from_file,
    parse_storage_options,
)
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DcpSafeError,
)
from dcp_safe.exporting import command as export_command
from dcp_safe.retention.apply import RetentionReport, apply_retention
from dcp_safe.retention.sweeper import DEFAULT_GRACE_S
from dcp_safe.topology import Root
from dcp_safe.untrusted import shown

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class _Unavailable(Exception):
    """A part of dcp_safe this installation lacks; exit status 1."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dcp-safe`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark's own parser
        return _guarded(err, lambda: _bench(argv[1:]), "ROOT")
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage and the error
        return _exit_code(exc)
    run = args.run
    with _library_warnings(err):
        return _guarded(
            err,
            lambda: run(args, _options(args), out),
            getattr(args, "root", None) or "ROOT",
        )


class _WarningLines(logging.Handler):
    """The library's logged warnings, printed as the CLI's own ``dcp-safe: warning:`` lines."""

    def __init__(self, err: Console) -> None:
        super().__init__(logging.WARNING)
        self._err = err

    def emit(self, record: logging.LogRecord) -> None:
        message = shown(" ".join(record.getMessage().split()))
        self._err.print(f"dcp-safe: warning: {message}", markup=False, highlight=False)


@contextlib.contextmanager
def _library_warnings(err: Console) -> Iterator[None]:
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


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else EXIT_USAGE if exc.code else EXIT_OK


def _guarded(err: Console, run: Callable[[], int], root: str) -> int:
    """Run a command; map expected errors to one line and an exit status."""
    try:
        return run()
    except UsageError as exc:
        return _fail(err, str(exc), EXIT_USAGE)
    except _Unavailable as exc:
        return _fail(err, str(exc), EXIT_FAILED)
    except (ConfigError, CheckpointNotFoundError) as exc:
        hint = f"run 'dcp-safe ls {root}' to see what is committed"
        return _fail(err, f"{exc}; {hint}", EXIT_USAGE)
    except CheckpointCorruptError as exc:
        return _fail(err, f"CORRUPT: {exc}", EXIT_FAILED)
    except (DcpSafeError, OSError) as exc:
        return _fail(err, f"{type(exc).__name__}: {exc}", EXIT_FAILED)


def _fail(err: Console, message: str, status: int) -> int:
    err.print(f"dcp-safe: error: {shown(message, 4000)}", markup=False, highlight=False)
    return status


def _parser() -> argparse.ArgumentParser:
    common = OneLineParser(add_help=False)
    common.add_argument(
        "--storage-options",
        metavar="JSON",
        help='fsspec/s3fs options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    parser = OneLineParser(
        prog="dcp-safe", description="Inspect and maintain dcp_safe checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_ls(sub, common)
    _add_verify(sub, common)
    _add_inspect(sub, common)
    _add_export(sub, common)
    _add_gc(sub, common)
    _add_demo(sub, common)
    sub.add_parser("bench", help="the quick benchmark (dcp-safe bench --help for its options)")
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-options``, checked against the command's roots (:mod:`dcp_safe.cli_args`)."""
    options = parse_storage_options(args.storage_options)
    check_roots(args, options)
    return options


def _require_root(root: str) -> None:
    """A local root that does not exist is a typo, not an empty root."""
    if "://" in root and not root.startswith("file://"):
        return
    path = root.removeprefix("file://")
    if not os.path.isdir(path):
        raise UsageError(f"no such directory: {path}; give the checkpoint root (a directory)")


# ---------------------------------------------------------------------------------------- ls


def _add_ls(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list committed checkpoints",
        description="Committed checkpoints, oldest first (by step). A damaged entry (a marker,"
        " manifest or control file that does not check out) is not listed; a warning on"
        " stderr names it, and the exit status stays 0.",
    )
    p.add_argument("root", help="checkpoint root: a directory or a URL such as s3://bucket/run")
    p.add_argument("--remote", metavar="URL", help="the replica root: show where each is committed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_ls)


def _ls(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    _require_root(args.root)
    err = Console(stderr=True, soft_wrap=True)

    def damaged(name: str, exc: CheckpointCorruptError) -> None:
        line = f"dcp-safe: warning: not listed: {shown(f'{name}: {exc}')}"
        err.print(line, markup=False, highlight=False)

    tiers = {"local": list_checkpoints(Root(args.root, options), on_damaged=damaged)}
    if args.remote:
        tiers["remote"] = list_checkpoints(Root(args.remote, options), on_damaged=damaged)
    rows = _merge_tiers(tiers)
    if args.json:
        out.print_json(
            json.dumps([_info_json(info, where) for info, where in rows]), ensure_ascii=True
        )
        return EXIT_OK
    # Text, not markup: a root or a name ("step_1\n" passes the name rule's `$`) prints as is.
    table = Table(title=Text(f"committed checkpoints under {shown(args.root)}"))
    for column in ("name", "step", "tiers", "size", "created (UTC)", "world size"):
        table.add_column(column, justify="left" if column in ("name", "tiers") else "right")
    for info, where in rows:
        table.add_row(
            Text(shown(info.name)),
            "-" if info.step is None else str(info.step),
            ", ".join(where),
            _size(info.size_bytes),
            _when(info.created_at),
            str(info.world_size),
        )
    out.print(table)
    if not rows:
        out.print("no committed checkpoints", highlight=False)
    return EXIT_OK


def _merge_tiers(
    tiers: dict[str, list[CheckpointInfo]],
) -> list[tuple[CheckpointInfo, list[str]]]:
    merged: dict[str, tuple[CheckpointInfo, list[str]]] = {}
    for tier, infos in tiers.items():
        for info in infos:
            merged.setdefault(info.name, (info, []))[1].append(tier)
    return sorted(
        merged.values(), key=lambda row: recency(row[0].step, row[0].created_at, row[0].name)
    )


def _info_json(info: CheckpointInfo, where: list[str]) -> dict[str, Any]:
    return {
        "name": info.name,
        "step": info.step,
        "tiers": where,
        "size_bytes": info.size_bytes,
        "created_at": info.created_at,
        "world_size": info.world_size,
        "path": info.path,
        "save_id": info.save_id,
    }


# ------------------------------------------------------------------------------------ verify


def _add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[common],
        help="check a checkpoint: exit 0 sound, 1 corrupt, 2 usage error",
        description="Every byte against its checksum (default, as verify_checkpoint()), and "
        "DCP's metadata and every item through the bounded decoders that loading uses: a "
        "planted pickle or a decompression bomb is refused (exit 1) as a load would refuse it. "
        "--quick: only the commit marker against the manifest and every file present with "
        "its recorded size.",
    )
    p.add_argument("root", help="checkpoint root")
    p.add_argument(
        "name", nargs="?", default=layout.LATEST, help=f"checkpoint name or {layout.LATEST!r}"
    )
    depth = p.add_mutually_exclusive_group()
    depth.add_argument(
        "--quick", dest="deep", action="store_false", help="marker, manifest and sizes only"
    )
    depth.add_argument(
        "--deep",
        dest="deep",
        action="store_true",
        help="every byte (the default; kept for scripts)",
    )
    p.set_defaults(deep=True)
    p.add_argument(
        "--signing-key-file",
        metavar="PATH",
        help="also require a signature by the key in PATH (default: $DCP_SAFE_SIGNING_KEY,"
        " if set); as text, 'hex:<digits>' is decoded",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="skip the restricted-unpickling check, as a load with allow_pickle=True does:"
        " only for a root you trust as much as code",
    )
    p.set_defaults(run=_verify)


def _verify(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    _require_root(args.root)
    root = Root(args.root, options)
    backend = open_backend(root)
    name = resolve_name(backend, catalog.latest_named(root, args.name, strict=True))
    manifest = open_committed(backend, name).manifest
    total = sum(record.size for record in manifest.files)
    key = key_from_file(args.signing_key_file)
    with _progress(out) as progress:
        task = progress.add_task(f"{'deep' if args.deep else 'quick'} {name}", total=total)
        report = verify_checkpoint(
            root,
            name,
            progress=lambda record: progress.advance(task, record.size),
            deep=args.deep,
            signing_key=key,
            allow_pickle=args.allow_pickle,
        )
    if not args.deep:
        how = "marker, manifest and file sizes"
    elif manifest.data_format is not None:  # another library's files: no DCP items to decode
        how = f"every byte matches its checksum ({manifest.data_format}'s files)"
    elif args.allow_pickle:
        how = "every byte matches its checksum (unpickling not checked: --allow-pickle)"
    else:
        how = (
            "every byte matches its checksum; DCP's metadata, every tensor item and"
            f" {report.objects_checked} object item(s) load safely"
        )
    out.print(f"OK {name}: {len(manifest.files)} files, {len(manifest.items)} items; {how}")
    return EXIT_OK


def _progress(out: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        console=out,
        disable=not out.is_terminal,
    )


# ----------------------------------------------------------------------------------- inspect


def _add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("inspect", parents=[common], help="tensors and objects in a checkpoint")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("name", help=f"checkpoint name or {layout.LATEST!r}")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_inspect)


def _inspect(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    _require_root(args.root)
    reader = SafeStorageReader(root := Root(args.root, options))
    reader.reset(catalog.latest_named(root, args.name))
    metadata = reader.read_metadata()
    name = reader.checkpoint_id or args.name
    stored = _stored_bytes(open_committed(reader.backend, name).manifest.items)
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
        out.print_json(
            json.dumps({"name": name, "entries": entries, "totals": totals}), ensure_ascii=True
        )
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
            _size(e["bytes"]),
            _size(e["stored_bytes"]),
            str(e["shards"]),
        )
    out.print(table)
    out.print(
        f"{totals['entries']} entries ({totals['tensors']} tensors): {_size(totals['bytes'])}"
        f" of tensor data, {_size(totals['stored_bytes'])} stored",
        highlight=False,
    )
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


def _add_export(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a checkpoint as safetensors or one torch file",
        description=export_command.DESCRIPTION,
    )
    export_command.add_arguments(p)
    p.set_defaults(run=_export)


def _export(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    _require_root(args.root)
    for line in export_command.run(args, Root(args.root, options)).summary():
        out.print(line, markup=False, highlight=False)
    return EXIT_OK


# ---------------------------------------------------------------------------------------- gc


def _add_gc(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "gc",
        parents=[common],
        help="apply retention and remove abandoned partial saves",
        description="Keeps the --keep newest checkpoints (plus the safety rules of "
        "dcp_safe.retention.policy.decide) and removes leftovers of failed saves older than "
        "--grace-s. Whatever --keep says, the two newest checkpoints are kept. Checkpoints "
        "without a step (not saved by a CheckpointManager) are left alone.",
    )
    p.add_argument("root", help="checkpoint root")
    p.add_argument(
        "--keep", type=int, required=True, metavar="N", help="newest checkpoints to keep"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="say what would be removed; remove nothing"
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help=f"leave partial saves idle for less than this (default {DEFAULT_GRACE_S:.0f})",
    )
    p.add_argument(
        "--allow-bucket-root",
        action="store_true",
        help="let ROOT be a whole bucket (s3://bucket); only if it holds nothing but checkpoints",
    )
    p.add_argument(
        "--signing-key-file",
        metavar="PATH",
        help="count only checkpoints signed by the key in PATH (default: $DCP_SAFE_SIGNING_KEY,"
        " if set); others are left in place and reported. As text, 'hex:<digits>' is decoded",
    )
    p.set_defaults(run=_gc)


def _gc(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    _require_root(args.root)
    if args.keep < 1:
        raise UsageError(f"--keep must be at least 1, got {args.keep}")
    report = apply_retention(
        Root(args.root, options),
        keep_last=args.keep,
        dry_run=args.dry_run,
        grace_s=args.grace_s,
        allow_bucket_root=args.allow_bucket_root,
        signing_key=key_from_file(args.signing_key_file),
    )
    for line in _gc_lines(report, args.grace_s):
        out.print(line, markup=False, highlight=False)  # names from storage: no markup
    return EXIT_OK


def _gc_lines(report: RetentionReport, grace_s: float) -> list[str]:
    verb = "would remove" if report.dry_run else "removed"
    return [
        *(f"{verb} checkpoint {name}" for name in report.dropped),
        *(f"{verb} abandoned partial save {entry}" for entry in report.sweep.removed),
        *(f"{verb} incomplete multipart upload {shown(u)}" for u in report.sweep.aborted_uploads),
        *(
            f"kept partial save {entry}: idle for less than {grace_s:g} s"
            for entry in report.sweep.too_recent
        ),
        f"kept {len(report.kept)} checkpoint(s): {', '.join(report.kept) or '-'}",
        *(
            f"not counted, left in place: {shown(name)} (damaged, or not signed with the key)"
            for name in report.not_counted
        ),
    ]


# -------------------------------------------------------------------------------------- demo


def _add_demo(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo",
        parents=[common],
        help="train a small model with async checkpoints to local disk + S3, then restore",
    )
    p.add_argument("--root", help="local checkpoint root (default: a new temporary directory)")
    p.add_argument(
        "--remote",
        metavar="URL",
        help="replica root, e.g. s3://bucket/prefix (default: an in-process moto S3 server)",
    )
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--save-every", type=int, default=5, help="steps between saves (default 5)")
    p.set_defaults(run=_demo)


def _demo(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    from dcp_safe.demo import DemoOptions, quiet, raise_if_failed, render, run_demo

    demo_options = DemoOptions(
        root=args.root,
        remote=None if args.remote is None else Root(args.remote, options),
        steps=args.steps,
        save_every=args.save_every,
    )
    with quiet():
        report = run_demo(demo_options, say=lambda line: out.print(line, highlight=False))
    render(report, out)
    raise_if_failed(report)
    return EXIT_OK


# ------------------------------------------------------------------------------------- bench


def _bench(argv: list[str]) -> int:
    try:
        from dcp_safe.bench import quick
    except ImportError as exc:
        raise _Unavailable(
            f"the benchmark (dcp_safe.bench.quick) is not available in this installation: {exc}"
        ) from None
    try:
        status: int = quick.main(argv)
    except SystemExit as exc:  # its argparse: --help, or a bad option
        return _exit_code(exc)
    return status


# ------------------------------------------------------------------------------------ format


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
