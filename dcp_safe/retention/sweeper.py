"""Collect what failed saves left behind, after a grace period.

What is collected, and nothing else: docs/architecture.md, "What failed saves leave", and
docs/s3.md, "Cleanup". Ages are the storage's modification times, never what a lease says
(only a backend that reports none falls back to a lease's own timestamp, when not in the
future). A root that is a whole bucket is refused unless ``allow_bucket_root``: there, other
applications' uploads would be one prefix check away.

Every entry is swept on its own: one that cannot be walked or removed is left with an escaped
warning and the sweep goes on. Walks are iterative and depth-bounded, so no leftover can make a
sweep, or a prune that runs one, raise ``RecursionError``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.multipart import abort_stale_uploads, incomplete_uploads, is_bucket_root
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.commit.takeover import last_change
from dcp_safe.errors import ConfigError, DcpSafeError, InvalidCheckpointNameError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest
from dcp_safe.topology import RootLike
from dcp_safe.untrusted import shown

__all__ = ["SweepReport", "check_sweepable", "sweep_partials"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 6 * 3600.0
# The probe's own name (FsspecBackend: PROBE_PREFIX + uuid4().hex), and nothing that merely
# starts like it.
_PROBE = re.compile(rf"{re.escape(layout.PROBE_PREFIX)}[0-9a-f]{{32}}")


@dataclass(frozen=True)
class SweepReport:
    """What a sweep removed (or would remove, in a dry run) and what it left for later."""

    removed: tuple[str, ...]
    too_recent: tuple[str, ...]
    dry_run: bool
    aborted_uploads: tuple[str, ...] = ()


def check_sweepable(backend: Backend, *, allow_bucket_root: bool = False) -> None:
    """Refuse a root the sweeper must not work on.

    Raises:
        ConfigError: ``backend`` is a whole bucket and ``allow_bucket_root`` is not set.
    """
    if is_bucket_root(backend) and not allow_bucket_root:
        raise ConfigError(
            f"{backend.url} is a whole bucket: cleaning it could touch other applications' "
            "objects; use a prefix (s3://bucket/run) or allow_bucket_root=True "
            "(dcp-safe gc --allow-bucket-root) if the bucket holds only dcp_safe checkpoints"
        )


def sweep_partials(
    root: RootLike,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
    allow_bucket_root: bool = False,
) -> SweepReport:
    """Remove leftovers of failed saves under ``root`` idle for at least ``grace_s``.

    Args:
        allow_bucket_root: sweep a root that is a whole bucket (see the module docstring).

    Raises:
        ConfigError: a negative or NaN grace period, or a bucket root without
            ``allow_bucket_root``.
    """
    if not grace_s >= 0:  # NaN too: every age would pass it, and everything be collected
        raise ConfigError(f"grace_s must be a number >= 0, got {grace_s}")
    backend = open_backend(root, storage_options)
    check_sweepable(backend, allow_bucket_root=allow_bucket_root)
    now = time.time() if now is None else now
    return strategy_for(backend).sweep(_Sweep(backend, grace_s, dry_run, now))


@dataclass(frozen=True)
class _Sweep:
    """One sweep of a root, for each way a root's failed saves are left
    (:meth:`~dcp_safe.commit.strategy.PublishStrategy.sweep` picks)."""

    backend: Backend
    grace_s: float
    dry_run: bool
    now: float

    def partial_folders(self) -> SweepReport:
        backend, grace_s, dry_run, now = self.backend, self.grace_s, self.dry_run, self.now
        removed, recent = _sweep_probes(backend, grace_s, dry_run, now), []
        for entry in backend.list_dir(""):
            partial = layout.is_partial_entry(entry)
            if not partial and not (
                _is_checkpoint_name(entry) and _is_empty_folder(backend, entry)
            ):
                continue
            with _passed_by_if_damaged(backend, entry):
                changed = backend.modified_at(entry)
                if changed is None:
                    continue  # gone meanwhile
                if now - changed < grace_s:
                    recent.append(entry)
                    continue
                # An empty folder under a checkpoint's name is removed only while it is empty.
                if not dry_run and not partial and not backend.remove_empty_dir(entry):
                    continue
                if not dry_run and partial:
                    backend.remove_tree(entry)
                removed.append(entry)
        return SweepReport(removed=tuple(removed), too_recent=tuple(recent), dry_run=dry_run)

    def leased_prefixes(self) -> SweepReport:
        backend, grace_s, dry_run, now = self.backend, self.grace_s, self.dry_run, self.now
        # Uploads are listed first: one that starts after this look is never a candidate.
        uploads = incomplete_uploads(backend)
        probes = _sweep_probes(backend, grace_s, dry_run, now)
        removed: list[str] = []
        recent: list[str] = []
        debris: list[str] = []  # paths under committed names, not names
        for entry in backend.list_dir(""):
            if not _is_checkpoint_name(entry):
                continue
            with _passed_by_if_damaged(backend, entry):
                # One listing shows the lease, the marker and the markers under _ranks/ at once.
                files = list(backend.walk_files(entry))
                if layout.COMMITTED_MARKER in files:
                    debris += _sweep_committed_debris(backend, entry, files, grace_s, dry_run, now)
                    continue
                leased = any("/" not in rel and layout.is_lease_file(rel) for rel in files)
                own = files and all(layout.is_own_object(f"{entry}/{rel}") for rel in files)
                if not leased and not own:
                    continue  # not a save of ours: an empty folder, or objects we never write
                if backend.exists(f"{entry}/{layout.COMMITTED_MARKER}"):
                    continue  # committed since the listing
                changed = last_change(backend, entry, now)
                if changed is None or now - changed < grace_s:
                    recent.append(entry)
                    continue
                if not dry_run:
                    backend.remove_tree(entry)
                removed.append(entry)
        aborted = abort_stale_uploads(
            backend,
            older_than_s=grace_s,
            now=now,
            dry_run=dry_run,
            in_progress=recent,
            collected=removed,
            uploads=uploads,
        )
        return SweepReport(
            removed=tuple(probes + removed + debris),
            too_recent=tuple(recent),
            dry_run=dry_run,
            aborted_uploads=aborted,
        )


@contextlib.contextmanager
def _passed_by_if_damaged(backend: Backend, entry: str) -> Iterator[None]:
    """One entry's sweep: an entry that cannot be walked or removed is passed by with a
    warning, so it never stops the sweep of the others."""
    try:
        yield
    except (DcpSafeError, OSError) as exc:
        log.warning("left alone: %s (%s)", shown(backend.full_path(entry)), shown(exc, 300))


def _is_empty_folder(backend: Backend, entry: str) -> bool:
    """A folder holding nothing at all: no checkpoint and no save's work (a local save works in
    a hidden partial folder), but in the way of a save under its name."""
    with contextlib.suppress(DcpSafeError, OSError):
        return backend.is_dir(entry) and not backend.list_dir(entry)
    return False


def _sweep_probes(backend: Backend, grace_s: float, dry_run: bool, now: float) -> list[str]:
    """Remove stray exclusive-create probe objects at the root older than ``grace_s``.

    One without a modification time is kept; a recent one is not reported (a live probe
    lasts two requests).
    """
    removed = []
    for entry in backend.list_dir(""):
        if not _PROBE.fullmatch(entry):
            continue
        with _passed_by_if_damaged(backend, entry):
            changed = backend.modified_at(entry)
            if changed is None or now - changed < grace_s:
                continue
            if not dry_run:
                backend.remove_file(entry)
            removed.append(entry)
    return removed


def _sweep_committed_debris(
    backend: Backend, name: str, files: list[str], grace_s: float, dry_run: bool, now: float
) -> list[str]:
    """Remove the debris under committed ``<name>/`` (``files``, relative to it) older than
    ``grace_s``; return the paths removed, relative to the root.

    A path the manifest lists is kept whatever its name, and an unreadable manifest keeps
    everything (readers report it; the sweeper does not judge it). Each candidate is aged on
    its own: a lease beside the marker may be a save's that is about to withdraw it.
    """
    candidates = [rel for rel in files if layout.is_debris(rel)]
    if not candidates:
        return []
    members = _members(backend, name)
    if members is None:
        return []
    removed = []
    for rel in candidates:
        if rel in members:
            continue
        changed = backend.modified_at(f"{name}/{rel}")
        if changed is None or now - changed < grace_s:
            continue
        if not dry_run:
            backend.remove_file(f"{name}/{rel}")
        removed.append(f"{name}/{rel}")
    return removed


def _members(backend: Backend, name: str) -> set[str] | None:
    """The paths committed checkpoint ``name``'s manifest lists (None: unreadable)."""
    rel = f"{name}/{layout.MANIFEST}"
    try:
        raw = backend.read_small(rel, MANIFEST_MAX_BYTES)
        manifest = Manifest.from_json(raw, backend.full_path(rel))
    except (OSError, DcpSafeError):
        return None
    return {record.path for record in manifest.files}


def _is_checkpoint_name(entry: str) -> bool:
    try:
        layout.validate_name(entry)
    except InvalidCheckpointNameError:
        return False
    return True
