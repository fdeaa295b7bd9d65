"""Collect what failed saves left behind, after a grace period.

A save that fails on some rank (or is killed) leaves work behind: DCP does not call rank 0 back
after another rank's failure. None of it is ever a checkpoint, but it holds space.

* Local roots: hidden ``.<name>.partial-<id>/`` directories, removed once idle for ``grace_s``
  (by the newest modification time of anything inside).
* Object stores: uncommitted ``<name>/`` prefixes still holding a writing lease taken more than
  ``grace_s`` ago, and incomplete multipart uploads under the root started more than ``grace_s``
  ago (a bucket lifecycle rule is the backstop for those; see docs/s3.md).

The grace period is what keeps a save still in progress — possibly from another process or
node — from ever being touched.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.backends.multipart import abort_stale_uploads
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.lease import lease_acquired_at
from dcp_safe.errors import ConfigError

__all__ = ["SweepReport", "sweep_partials"]

DEFAULT_GRACE_S = 6 * 3600.0


@dataclass(frozen=True)
class SweepReport:
    """What a sweep removed (or would remove, in a dry run) and what it left for later."""

    removed: tuple[str, ...]
    too_recent: tuple[str, ...]
    dry_run: bool
    aborted_uploads: tuple[str, ...] = ()


def sweep_partials(
    root: str | os.PathLike[str],
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
) -> SweepReport:
    """Remove leftovers of failed saves under ``root`` that are older than ``grace_s``.

    Raises:
        ConfigError: a negative grace period.
    """
    if grace_s < 0:
        raise ConfigError(f"grace_s must be >= 0, got {grace_s}")
    backend = open_backend(os.fspath(root), storage_options)
    now = time.time() if now is None else now
    if not isinstance(backend, LocalBackend):
        return _sweep_object_store(backend, grace_s, dry_run, now)
    removed, recent = [], []
    for entry in backend.list_dir(""):
        if not layout.is_partial_entry(entry):
            continue
        if now - _last_modified(os.path.join(backend.root, entry)) < grace_s:
            recent.append(entry)
            continue
        if not dry_run:
            backend.remove_tree(entry)
        removed.append(entry)
    return SweepReport(removed=tuple(removed), too_recent=tuple(recent), dry_run=dry_run)


def _last_modified(path: str) -> float:
    newest = os.stat(path).st_mtime
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
            except FileNotFoundError:
                continue  # removed while we looked: still someone's live work
    return newest


def _sweep_object_store(backend: Backend, grace_s: float, dry_run: bool, now: float) -> SweepReport:
    removed, recent = [], []
    for entry in backend.list_dir(""):
        if backend.exists(f"{entry}/{layout.COMMITTED_MARKER}"):
            continue
        acquired = lease_acquired_at(backend, entry)
        if acquired is None:
            continue  # no lease: not a save of ours
        if now - acquired < grace_s:
            recent.append(entry)
            continue
        if not dry_run:
            backend.remove_tree(entry)
        removed.append(entry)
    aborted = abort_stale_uploads(
        backend, older_than_s=grace_s, now=now, dry_run=dry_run, in_progress=recent
    )
    return SweepReport(
        removed=tuple(removed), too_recent=tuple(recent), dry_run=dry_run, aborted_uploads=aborted
    )
