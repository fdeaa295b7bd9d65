"""``dcp-safe``: list, verify, inspect, export and collect checkpoints; read a root's history,
show and compare manifests, replicate one checkpoint; run the demo and bench.

This module parses arguments, calls the library, and prints; the work is done by
:mod:`dcp_safe.checkpoints.catalog`, :mod:`dcp_safe.retention`, :mod:`dcp_safe.adapters`,
:mod:`dcp_safe.exporting`, :mod:`dcp_safe.replication` and :mod:`dcp_safe.demo`. Tables and
progress bars are rich's.

A subcommand is an ``_add_<verb>(sub, common)`` function (its parser lines, ending in
``set_defaults(run=...)``) listed in :data:`_COMMANDS`, and its ``run(args, options, out)``,
which returns the exit status; :mod:`dcp_safe.cli_manifests` holds ``history``, ``show``,
``diff`` and ``replicate``. Every data subcommand takes ``--json``: one document on stdout, its
schema in :mod:`dcp_safe.cli_schemas` (docs/cli.md). Exit codes: one table,
:data:`dcp_safe.cli_output.EXIT_CODES`. Expected errors print one line (or, with ``--json``, one
``{"error", "message", "exit_code"}`` document), never a traceback.

Nothing here imports torch at module level: what needs it (``inspect``, ``export``, ``demo``,
deep verification) imports it when it runs, so ``ls``, ``history`` and ``show`` start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dcp_safe import cli_adopt, cli_manifests, cli_tensors, layout
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
    require_root,
)
from dcp_safe.cli_output import EXIT_FAILED as EXIT_FAILED
from dcp_safe.cli_output import EXIT_NOT_FOUND as EXIT_NOT_FOUND
from dcp_safe.cli_output import (
    EXIT_OK,
    EXIT_USAGE,
    Unavailable,
    add_subcommand,
    emit_json,
    exit_codes_text,
    fail,
    fail_json,
    failure,
    library_warnings,
    metrics_text,
    print_columns,
    size_text,
    when_text,
)
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.retention.sweeper import DEFAULT_GRACE_S, SweepReport
from dcp_safe.topology import Root
from dcp_safe.untrusted import shown

if TYPE_CHECKING:  # imported where used: ``ls`` starts without them
    from rich.progress import Progress

    from dcp_safe.retention.apply import RetentionReport

Run = Callable[[argparse.Namespace, dict[str, Any] | None, Console], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dcp-safe`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark's own parser
        return _guarded(out, err, lambda: _bench(argv[1:]), "ROOT", as_json=False)
    as_json = "--json" in argv
    try:
        with _usage_errors(out, as_json):
            args = _parser(argv[0] if argv else None).parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage and the error (or JSON did)
        return _exit_code(exc)
    run: Run = args.run
    as_json = bool(getattr(args, "json", False))
    with library_warnings(err):
        return _guarded(
            out,
            err,
            lambda: run(args, _options(args), out),
            getattr(args, "root", None) or "ROOT",
            as_json=as_json,
        )


@contextlib.contextmanager
def _usage_errors(out: Console, as_json: bool) -> Iterator[None]:
    """With ``--json``, argparse's one-line error becomes the JSON error document."""
    if not as_json:
        yield
        return
    caught = io.StringIO()
    try:
        with contextlib.redirect_stderr(caught):
            yield
    except SystemExit as exc:
        text = caught.getvalue().strip()
        if text:  # an error (help goes to stdout and exits 0 with nothing here)
            fail_json(out, None, text.removeprefix("dcp-safe: error: "), _exit_code(exc))
        raise


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else EXIT_USAGE if exc.code else EXIT_OK


def _guarded(
    out: Console, err: Console, run: Callable[[], int], root: str, *, as_json: bool
) -> int:
    """Run a command; map expected errors to one line (or one JSON document) and a status."""
    try:
        return run()
    except Exception as exc:
        mapped = failure(exc, root)
        if mapped is None:
            raise
        status, message = mapped
        return fail_json(out, exc, message, status) if as_json else fail(err, message, status)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` (the first argument) lets a verb whose arguments need torch to
    describe them (``export``) build them only when it is the one run."""
    storage = OneLineParser(add_help=False)
    storage.add_argument(
        "--storage-options",
        metavar="JSON",
        help='fsspec/s3fs options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    common = OneLineParser(add_help=False, parents=[storage])
    common.add_argument(
        "--json",
        action="store_true",
        help='print one JSON document (schema: docs/cli.md); errors too, as {"error": ...}',
    )
    parser = OneLineParser(
        prog="dcp-safe",
        description="Inspect and maintain dcp_safe checkpoints.",
        epilog=exit_codes_text() + "\n\nReference: docs/cli.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub, common)
    cli_tensors.add_export(sub, common, full=command == "export")
    _add_demo(sub, storage)
    sub.add_parser("bench", help="the quick benchmark (dcp-safe bench --help for its options)")
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-options``, checked against the command's roots (:mod:`dcp_safe.cli_args`)."""
    options = parse_storage_options(args.storage_options)
    check_roots(args, options)
    return options


# ---------------------------------------------------------------------------------------- ls


def _add_ls(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "ls",
        common,
        help="list committed checkpoints",
        description="Committed checkpoints, oldest first (by step). A damaged entry (a marker,"
        " manifest or control file that does not check out) is not listed; a warning on"
        " stderr names it, and the exit status stays 0.",
    )
    p.add_argument("root", help="checkpoint root: a directory or a URL such as s3://bucket/run")
    p.add_argument("--remote", metavar="URL", help="the replica root: show where each is committed")
    p.set_defaults(run=_ls)


def _ls(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    require_root(args.root)
    err = Console(stderr=True, soft_wrap=True)

    def damaged(name: str, exc: CheckpointCorruptError) -> None:
        line = f"dcp-safe: warning: not listed: {shown(f'{name}: {exc}')}"
        err.print(line, markup=False, highlight=False)

    tiers = {"local": list_checkpoints(Root(args.root, options), on_damaged=damaged)}
    if args.remote:
        tiers["remote"] = list_checkpoints(Root(args.remote, options), on_damaged=damaged)
    rows = _merge_tiers(tiers)
    if args.json:
        emit_json(out, [_info_json(info, where) for info, where in rows])
        return EXIT_OK
    print_columns(
        out,
        f"committed checkpoints under {args.root}",
        ("name", "step", "tiers", "size", "created (UTC)", "world size", "metrics"),
        [
            (
                info.name,
                "-" if info.step is None else str(info.step),
                ", ".join(where),
                size_text(info.size_bytes),
                when_text(info.created_at),
                str(info.world_size),
                metrics_text(info.metrics) or "-",
            )
            for info, where in rows
        ],
        right={1, 3, 4, 5},
    )
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
        "metrics": None if info.metrics is None else dict(info.metrics),
    }


# ------------------------------------------------------------------------------------ verify


def _add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "verify",
        common,
        help="check a checkpoint: exit 0 sound, 1 damaged (see the exit codes)",
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
    require_root(args.root)
    root = Root(args.root, options)
    backend = open_backend(root)
    name = resolve_name(backend, catalog.latest_named(root, args.name, strict=True))
    manifest = open_committed(backend, name).manifest
    total = sum(record.size for record in manifest.files)
    key = key_from_file(args.signing_key_file)
    with _progress(out, hidden=args.json) as progress:
        task = progress.add_task(f"{'deep' if args.deep else 'quick'} {name}", total=total)
        report = verify_checkpoint(
            root,
            name,
            progress=lambda record: progress.advance(task, record.size),
            deep=args.deep,
            signing_key=key,
            allow_pickle=args.allow_pickle,
        )
    if args.json:
        emit_json(
            out,
            {
                "name": name,
                "ok": True,
                "deep": args.deep,
                "format": manifest.data_format or "dcp",
                "files_checked": report.files_checked,
                "items_checked": report.items_checked,
                "objects_checked": report.objects_checked,
                "bytes_read": report.bytes_read,
                "signature_checked": key is not None or _env_key_set(),
                "pickle_checked": args.deep and not args.allow_pickle,
                "seconds": report.seconds,
            },
        )
        return EXIT_OK
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


def _env_key_set() -> bool:
    return bool(os.environ.get("DCP_SAFE_SIGNING_KEY"))


def _progress(out: Console, *, hidden: bool = False) -> Progress:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        console=out,
        disable=hidden or not out.is_terminal,
    )


# ---------------------------------------------------------------------------------------- gc


def _add_gc(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_subcommand(
        sub,
        "gc",
        common,
        help="apply retention, remove abandoned partial saves, restore from the trash",
        description="Keeps the --keep newest checkpoints (plus the safety rules of "
        "dcp_safe.retention.policy.decide) and removes leftovers of failed saves older than "
        "--grace-s. Whatever --keep says, the newest checkpoint and two validated ones are "
        "kept. Checkpoints "
        "without a step (not saved by a CheckpointManager) are left alone. --restore NAME"
        " brings a checkpoint back from the trash (docs/retention.md) instead.",
    )
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--keep", type=int, metavar="N", help="newest checkpoints to keep")
    p.add_argument(
        "--restore",
        metavar="NAME",
        help="commit NAME again from the trash, once every byte is checked; nothing else",
    )
    p.add_argument(
        "--trash-grace-s",
        type=float,
        metavar="S",
        help="also delete what has been in the trash for S seconds (default: the trash is kept)",
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
    from dcp_safe.retention.apply import apply_retention

    require_root(args.root)
    if args.restore is not None:
        return _restore(args, options, out)
    if args.keep is None:
        raise UsageError("gc needs --keep N (or --restore NAME)")
    if args.keep < 1:
        raise UsageError(f"--keep must be at least 1, got {args.keep}")
    report = apply_retention(
        Root(args.root, options),
        keep_last=args.keep,
        dry_run=args.dry_run,
        grace_s=args.grace_s,
        allow_bucket_root=args.allow_bucket_root,
        signing_key=key_from_file(args.signing_key_file),
        trash_grace_s=args.trash_grace_s,
    )
    if args.json:
        emit_json(out, _gc_json(report))
        return EXIT_OK
    for line in _gc_lines(report, args.grace_s):
        out.print(line, markup=False, highlight=False)  # names from storage: no markup
    return EXIT_OK


def _restore(args: argparse.Namespace, options: dict[str, Any] | None, out: Console) -> int:
    from dcp_safe.retention.apply import RetentionReport
    from dcp_safe.retention.trash import restore_trashed

    key = key_from_file(args.signing_key_file)
    checked = restore_trashed(Root(args.root, options), args.restore, signing_key=key)
    if args.json:
        empty = _gc_json(RetentionReport(kept=(), dropped=(), sweep=_NO_SWEEP, dry_run=False))
        emit_json(out, {**empty, "restored": [checked.name]})
        return EXIT_OK
    out.print(
        f"restored {checked.name} from the trash: {checked.files_checked} files and"
        f" {checked.items_checked} items checked",
        markup=False,
        highlight=False,
    )
    return EXIT_OK


_NO_SWEEP = SweepReport(removed=(), too_recent=(), dry_run=False)


def _gc_json(report: RetentionReport) -> dict[str, Any]:
    trash = report.trash or _NO_SWEEP
    return {
        "restored": [],
        "trash_removed": list(trash.removed),
        "trash_kept": list(trash.too_recent),
        "dry_run": report.dry_run,
        "kept": list(report.kept),
        "removed": list(report.dropped),
        "not_counted": list(report.not_counted),
        "partials_removed": list(report.sweep.removed),
        "partials_too_recent": list(report.sweep.too_recent),
        "uploads_aborted": list(report.sweep.aborted_uploads),
    }


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
        *(f"{verb} from the trash {entry}" for entry in (report.trash or _NO_SWEEP).removed),
        *(f"kept in the trash {entry}" for entry in (report.trash or _NO_SWEEP).too_recent),
        f"kept {len(report.kept)} checkpoint(s): {', '.join(report.kept) or '-'}",
        *(
            f"not counted, left in place: {shown(name)} (damaged, or not signed with the key)"
            for name in report.not_counted
        ),
    ]


# -------------------------------------------------------------------------------------- demo


def _add_demo(sub: Any, storage: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo",
        parents=[storage],
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
        raise Unavailable(
            f"the benchmark (dcp_safe.bench.quick) is not available in this installation: {exc}"
        ) from None
    try:
        status: int = quick.main(argv)
    except SystemExit as exc:  # its argparse: --help, or a bad option
        return _exit_code(exc)
    return status


# The data subcommands, in the order ``--help`` lists them (export, demo and bench follow).
_COMMANDS: list[Callable[[Any, argparse.ArgumentParser], None]] = [
    _add_ls,
    _add_verify,
    cli_tensors.add_inspect,
    _add_gc,
    cli_manifests.add_history,
    cli_manifests.add_show,
    cli_manifests.add_diff,
    cli_manifests.add_replicate,
    cli_adopt.add_adopt,
]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
