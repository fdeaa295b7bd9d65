"""Collect abandoned partial directories, after a grace period.

A save that fails on some rank leaves its hidden ``.<name>.partial-<id>/`` behind: DCP does not
call rank 0 back after another rank's failure. Such directories are never checkpoints, but they
hold disk space. They are removed only once they have been idle for ``grace_s`` (by the newest
modification time of anything inside), so a save still in progress — possibly from another
process — is never touched.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from dcp_safe.commit import protocol
from dcp_safe.errors import ConfigError
from dcp_safe.storage.local_backend import LocalBackend
from dcp_safe.storage.roots import open_backend

__all__ = ["SweepReport", "sweep_partials"]

DEFAULT_GRACE_S = 6 * 3600.0


@dataclass(frozen=True)
class SweepReport:
    """What a sweep removed (or would remove, in a dry run) and what it left for later."""

    removed: tuple[str, ...]
    too_recent: tuple[str, ...]
    dry_run: bool


def sweep_partials(
    root: str | os.PathLike[str],
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
) -> SweepReport:
    """Remove hidden partial directories under ``root`` idle for longer than ``grace_s``.

    Raises:
        ConfigError: a negative grace period, or a root that is not a local directory (object
            stores keep no partial directories; their leftovers are handled by the S3 tier).
    """
    if grace_s < 0:
        raise ConfigError(f"grace_s must be >= 0, got {grace_s}")
    backend = open_backend(os.fspath(root), storage_options)
    if not isinstance(backend, LocalBackend):
        raise ConfigError(f"sweep_partials works on local roots; {root} is not one")
    now = time.time() if now is None else now
    removed, recent = [], []
    for entry in backend.list_dir(""):
        if not protocol.is_partial_entry(entry):
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
