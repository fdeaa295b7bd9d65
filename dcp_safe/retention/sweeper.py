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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.backends.s3_upload import abort_stale_uploads, incomplete_uploads, is_bucket_root
from dcp_safe.commit.lease import last_change
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import ConfigError, DcpSafeError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest
from dcp_safe.retention.trash import trash_entries
from dcp_safe.topology import RootLike, as_root
from dcp_safe.untrusted import shown

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


def open_sweepable(root: RootLike, grace_s: float, *, allow_bucket_root: bool) -> Backend:
    """The backend of a root the sweeper may work on, refused (ConfigError) before anything is
    removed: a negative or NaN grace period (every age would pass NaN, and everything be
    collected), or a whole bucket without ``allow_bucket_root``."""
    if not grace_s >= 0:
        raise ConfigError(f"grace_s must be a number >= 0, got {grace_s}")
    backend = open_backend(root)
    if is_bucket_root(backend) and not allow_bucket_root:
        raise ConfigError(
            f"{backend.url} is a whole bucket: cleaning it could touch other applications' "
            "objects; use a prefix (s3://bucket/run) or allow_bucket_root=True "
            "(dcp-safe gc --allow-bucket-root) if the bucket holds only dcp_safe checkpoints"
        )
    return backend


def sweep_partials(
    root: RootLike,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
    allow_bucket_root: bool = False,
) -> SweepReport:
    """Remove leftovers of failed saves under ``root`` idle for at least ``grace_s``
    (``allow_bucket_root``: see the module docstring; ConfigError: see :func:`open_sweepable`).
    """
    backend = open_sweepable(
        as_root(root, storage_options), grace_s, allow_bucket_root=allow_bucket_root
    )
    leftovers = _Sweep(backend, grace_s, dry_run, time.time() if now is None else now)
    return strategy_for(backend).sweep(leftovers.partial_folders, leftovers.leased_prefixes)


def sweep_trash(
    backend: Backend, grace_s: float, *, dry_run: bool = False, now: float | None = None
) -> SweepReport:
    """Delete the checkpoints in the trash (:mod:`dcp_safe.retention.trash`) whose trash marker
    is ``grace_s`` old (one with no age is kept; ConfigError for a negative or NaN one, which
    would delete the whole trash). A folder whose deletion began (its marker is gone: a crash
    mid-delete) goes at once; on an object store, what a deletion cut short leaves is the
    partial sweep's (no marker, no lease)."""
    if not grace_s >= 0:
        raise ConfigError(f"the trash's grace period must be seconds >= 0, got {grace_s}")
    sweep = _Sweep(backend, grace_s, dry_run, time.time() if now is None else now)
    removed: list[str] = []
    recent: list[str] = []
    for _, entry in trash_entries(backend):
        marker = f"{entry}/{layout.TRASH_MARKER}"
        with sweep._passed_by_if_damaged(entry):
            begun = not backend.exists(marker)
            changed = None if begun else backend.modified_at(marker)
            if not begun and (changed is None or sweep.now - changed < grace_s):
                recent.append(entry)  # (no age: kept, as the partial sweep keeps one)
                continue
            if not dry_run:
                # The markers first: a deletion cut short leaves no checkpoint committed or in
                # the trash whose files are part gone (the commit marker is still there where
                # a prune stopped half-way on an object store).
                backend.remove_file(f"{entry}/{layout.COMMITTED_MARKER}")
                backend.remove_file(marker)
                backend.remove_tree(entry)
            removed.append(entry)
    return SweepReport(removed=tuple(removed), too_recent=tuple(recent), dry_run=dry_run)


@dataclass(frozen=True)
class _Sweep:
    """One sweep of a root, for each way a root's failed saves are left
    (:meth:`~dcp_safe.commit.strategy.PublishStrategy.sweep` picks)."""

    backend: Backend
    grace_s: float
    dry_run: bool
    now: float

    def partial_folders(self) -> SweepReport:
        removed, recent = self._probes(), list[str]()
        for entry in self.backend.list_dir(""):
            partial = layout.is_partial_entry(entry)
            if partial or (layout.is_valid_name(entry) and self._is_empty_folder(entry)):
                # An empty folder under a checkpoint's name is removed only while it is empty.
                remove = self.backend.remove_tree if partial else self.backend.remove_empty_dir
                if self._idle_removed(entry, remove, recent):
                    removed.append(entry)
        return SweepReport(removed=tuple(removed), too_recent=tuple(recent), dry_run=self.dry_run)

    def leased_prefixes(self) -> SweepReport:
        backend, now = self.backend, self.now
        # Uploads are listed first: one that starts after this look is never a candidate.
        uploads = incomplete_uploads(backend)
        removed = self._probes()
        recent: list[str] = []
        collected: list[str] = []  # whole prefixes (not debris under committed names)
        for entry in backend.list_dir(""):
            if not layout.is_valid_name(entry):
                continue
            with self._passed_by_if_damaged(entry):
                # One listing shows the lease, the marker and the markers under _ranks/ at once.
                files = list(backend.walk_files(entry))
                if layout.COMMITTED_MARKER in files:
                    removed += self._committed_debris(entry, files)
                    continue
                leased = any("/" not in rel and layout.is_lease_file(rel) for rel in files)
                own = files and all(layout.is_own_object(f"{entry}/{rel}") for rel in files)
                if not leased and not own:
                    continue  # not a save of ours: an empty folder, or objects we never write
                if not leased and _finished_by_dcp(files):
                    # DCP's own writer finished it (a save of ours leaves its rank manifests):
                    # somebody's checkpoint, perhaps to be adopted, never a leftover.
                    log.warning(
                        "left alone: %s is a DCP checkpoint dcp_safe did not commit "
                        "(dcp-safe adopt brings it under the root)",
                        shown(backend.full_path(entry)),
                    )
                    continue
                if backend.exists(f"{entry}/{layout.COMMITTED_MARKER}"):
                    continue  # committed since the listing
                changed = last_change(backend, entry, now)
                if changed is None or now - changed < self.grace_s:
                    recent.append(entry)
                    continue
                if not self.dry_run:
                    backend.remove_tree(entry)
                collected.append(entry)
        aborted = abort_stale_uploads(
            backend,
            older_than_s=self.grace_s,
            now=now,
            dry_run=self.dry_run,
            in_progress=recent,
            collected=collected,
            uploads=uploads,
        )
        return SweepReport(tuple(removed + collected), tuple(recent), self.dry_run, aborted)

    @contextlib.contextmanager
    def _passed_by_if_damaged(self, entry: str) -> Iterator[None]:
        """One entry's sweep: an entry that cannot be walked or removed is passed by with a
        warning, so it never stops the sweep of the others."""
        try:
            yield
        except (DcpSafeError, OSError) as exc:
            where = shown(self.backend.full_path(entry))
            log.warning("left alone: %s (%s)", where, shown(exc, 300))

    def _is_empty_folder(self, entry: str) -> bool:
        """A folder holding nothing at all: no checkpoint and no save's work (a local save
        works in a hidden partial folder), but in the way of a save under its name."""
        with contextlib.suppress(DcpSafeError, OSError):
            return self.backend.is_dir(entry) and not self.backend.list_dir(entry)
        return False

    def _probes(self) -> list[str]:
        """Remove stray exclusive-create probe objects at the root older than ``grace_s``; a
        recent one is not reported (a live probe lasts two requests)."""
        probes = [entry for entry in self.backend.list_dir("") if _PROBE.fullmatch(entry)]
        return [rel for rel in probes if self._idle_removed(rel)]

    def _idle_removed(
        self,
        rel: str,
        remove: Callable[[str], bool | None] | None = None,
        recent: list[str] | None = None,
    ) -> bool:
        """Whether ``rel``, idle for ``grace_s``, was removed with ``remove`` (a file's removal by
        default; one that answers False removed nothing), or in a dry run would be. One with no
        modification time (gone meanwhile) is kept; a recent one is added to ``recent``."""
        with self._passed_by_if_damaged(rel):
            changed = self.backend.modified_at(rel)
            if changed is None:
                return False
            if self.now - changed < self.grace_s:
                if recent is not None:
                    recent.append(rel)
                return False
            return self.dry_run or (remove or self.backend.remove_file)(rel) is not False
        return False

    def _committed_debris(self, name: str, files: list[str]) -> list[str]:
        """Remove the debris under committed ``<name>/`` (``files``, relative to it) older
        than ``grace_s``; the paths removed, relative to the root. A path the manifest lists is
        kept whatever its name, and an unreadable manifest keeps everything (readers report it;
        the sweeper does not judge it). Each candidate is aged on its own: a lease beside the
        marker may be a save's that is about to withdraw it."""
        candidates = [rel for rel in files if layout.is_debris(rel)]
        if not candidates:
            return []
        rel = f"{name}/{layout.MANIFEST}"
        try:
            raw = self.backend.read_small(rel, MANIFEST_MAX_BYTES)
            manifest = Manifest.from_json(raw, self.backend.full_path(rel))
        except (OSError, DcpSafeError):
            return []
        members = {record.path for record in manifest.files}
        paths = [f"{name}/{rel}" for rel in candidates if rel not in members]
        return [path for path in paths if self._idle_removed(path)]


def _finished_by_dcp(files: list[str]) -> bool:
    """Whether ``files`` (relative to a prefix) are exactly what DCP's own writer leaves: its
    ``.metadata`` and shards."""
    shards = [rel for rel in files if layout.rank_of_shard(rel) is not None]
    return layout.DCP_METADATA in files and len(shards) == len(files) - 1
