"""Find and abort dcp_safe's own incomplete S3 multipart uploads under a root.

An upload that was never completed or aborted (a killed writer) is invisible as an object but
is billed as storage. ``FsspecBackend`` aborts its own failed uploads at once; this collects what
a killed process could not, for the sweeper. Other file systems have no such thing: no-op.

Only uploads dcp_safe could have started are candidates: under the root, with a key of its own
layout (``<name>/<shard, metadata, manifest...>``, :func:`dcp_safe.layout.is_own_object`). A
bucket is shared ground: another application's upload under the same root or beside it is never
touched. An upload whose start time the server does not report has no age; it is aborted only
together with its save's prefix (the sweeper found that save abandoned), otherwise left to the
bucket's lifecycle rule.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Collection
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend, unwrapped

__all__ = ["abort_stale_uploads", "abort_uploads_under", "incomplete_uploads", "is_bucket_root"]


def is_bucket_root(backend: Backend) -> bool:
    """True when the backend's root is a whole bucket (``s3://bucket``), not a prefix in one."""
    backend = unwrapped(backend)
    root = str(getattr(backend, "root", "")).strip("/")
    return bool(getattr(backend, "object_store", False)) and bool(root) and "/" not in root


def incomplete_uploads(backend: Backend) -> list[dict[str, Any]]:
    """Incomplete multipart uploads whose key lies under the backend's root (S3 only)."""
    backend = unwrapped(backend)
    fs = getattr(backend, "fs", None)
    if fs is None or not hasattr(fs, "list_multipart_uploads"):
        return []
    bucket, _, prefix = str(backend.root).partition("/")  # type: ignore[attr-defined]
    uploads: list[dict[str, Any]] = fs.list_multipart_uploads(bucket)
    prefix = f"{prefix}/" if prefix else ""
    return [dict(u, Bucket=bucket) for u in uploads if str(u.get("Key", "")).startswith(prefix)]


def abort_stale_uploads(
    backend: Backend,
    *,
    older_than_s: float,
    now: float,
    dry_run: bool = False,
    in_progress: Collection[str] = (),
    collected: Collection[str] = (),
    uploads: list[dict[str, Any]] | None = None,
    only: str | None = None,
) -> tuple[str, ...]:
    """Abort dcp_safe's uploads under the root started more than ``older_than_s`` before ``now``.

    Args:
        in_progress: checkpoint names with a save known to be live; their uploads are kept
            whatever their start time says.
        collected: checkpoint names whose abandoned save the caller is removing; their uploads
            are aborted even when the server reports no start time.
        uploads: the candidates, as :func:`incomplete_uploads` listed them (listed now if None).
        only: the one checkpoint name whose uploads are candidates (None: every name).

    Returns:
        The ``s3://bucket/key`` of each upload aborted (or, in a dry run, that would be).
    """
    backend = unwrapped(backend)
    aborted = []
    root_prefix = str(backend.root).partition("/")[2]  # type: ignore[attr-defined]
    for upload in incomplete_uploads(backend) if uploads is None else uploads:
        rel = str(upload["Key"]).removeprefix(root_prefix).lstrip("/")
        name = rel.split("/", 1)[0]
        if not layout.is_own_object(rel) or name in in_progress or only not in (None, name):
            continue
        initiated = upload.get("Initiated")
        if isinstance(initiated, datetime.datetime):
            if now - initiated.timestamp() < older_than_s:
                continue
        elif name not in collected:
            continue  # no age: only with its abandoned save's prefix
        if not dry_run:
            backend.fs.call_s3(  # type: ignore[attr-defined]
                "abort_multipart_upload",
                Bucket=upload["Bucket"],
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )
        aborted.append(f"s3://{upload['Bucket']}/{upload['Key']}")
    return tuple(aborted)


def abort_uploads_under(backend: Backend, name: str) -> tuple[str, ...]:
    """Abort every dcp_safe upload under ``<name>/``, whatever its age: for a save that took
    the name over from a dead or fenced one, before any of its own ranks started an upload.

    Returns:
        The ``s3://bucket/key`` of each upload aborted.
    """
    # An infinite "now" makes every upload old enough, one without a start time included.
    return abort_stale_uploads(
        backend, older_than_s=0.0, now=math.inf, collected=(name,), only=name
    )
