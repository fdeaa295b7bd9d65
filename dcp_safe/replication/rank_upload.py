"""Per-rank uploads to a shared remote root, coordinated through storage markers only.

Shared by ``NodeLocalWriter`` and ``SafeStorageWriter(replicate_to=...)`` on several ranks. The
steps, the markers and the deadlines: docs/architecture.md, "Per-rank uploads".
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.coordination.markers import await_committed, poll
from dcp_safe.errors import (
    CheckpointCorruptError,
    CommitError,
    ConfigError,
    ReplicationSkippedError,
    ReplicationTimeoutError,
    UploadTimeoutError,
    describe,
)
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import FileRecord, Manifest, RankManifest
from dcp_safe.manifest.verify import DEFAULT_CHUNK_BYTES, FileCheck, items_by_file
from dcp_safe.replication.copying import Copier

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class UploadOptions:
    """How long and how often the background steps of a per-rank upload wait.

    ``remote_timeout_s``: how long rank 0 waits for every rank's remote rank manifest (and a rank
    for the local commit it uploads from); a rank waits twice this for the remote commit, so that
    rank 0's verdict reaches it first. ``chunk_bytes``: read and uploaded at a time, per file.
    """

    remote_timeout_s: float = 1800.0
    poll_s: float = 0.5
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.remote_timeout_s <= 0 or self.poll_s <= 0 or self.chunk_bytes < 1:
            raise ConfigError(
                "remote_timeout_s, poll_s and chunk_bytes must be positive, got "
                f"{self.remote_timeout_s}, {self.poll_s}, {self.chunk_bytes}"
            )

    def poll(self, check: Callable[[], T | None], waiting_for: str) -> T:
        """:func:`~dcp_safe.coordination.markers.poll` of ``check`` every ``poll_s``, for at most
        ``remote_timeout_s``; at the deadline, a ReplicationTimeoutError naming ``waiting_for``."""
        timeout_s = self.remote_timeout_s
        found = poll(check, timeout_s, pause_s=self.poll_s, max_pause_s=self.poll_s)
        if found is None:
            raise ReplicationTimeoutError(f"gave up after {timeout_s} s waiting for {waiting_for}")
        return found


def upload_rank_part(
    copier: Copier, local_dir: str, work: str, rank: int, expected: FileRecord | None = None
) -> None:
    """Copy rank ``rank``'s files from ``local_dir`` to ``work``, verified; its manifest last.

    The files are those its rank manifest lists (whose bytes must match ``expected``, its record
    in a committed checkpoint's manifest); the remote rank manifest, written last, says
    "arrived". Each remote path goes into ``copier.uploaded`` before it is written.

    Raises:
        CheckpointCorruptError: a local file (or the rank manifest) does not match its record.
        StorageError: reading or writing failed.
    """
    rel = layout.rank_manifest_name(rank)
    path = copier.local.full_path(f"{local_dir}/{rel}")
    raw = copier.local.read_small(f"{local_dir}/{rel}", MANIFEST_MAX_BYTES)
    if expected is not None:
        if len(raw) != expected.size:
            raise CheckpointCorruptError(
                path, "file size differs from the manifest", expected=expected.size, actual=len(raw)
            )
        check = FileCheck(path, expected, [])
        check.update(raw)
        check.finish()
    manifest = RankManifest.from_json(raw, path)
    if manifest.rank != rank:
        raise CheckpointCorruptError(path, f"rank manifest of rank {manifest.rank}, not {rank}")
    copier.copy_folder(local_dir, work, manifest.files, items_by_file(path, manifest), [rel])
    copier.before_each()
    copier.uploaded.append(f"{work}/{rel}")
    copier.remote.write_bytes(f"{work}/{rel}", raw)


def report_rank_failure(
    remote: Backend, work: str, rank: int, save_id: str, exc: BaseException
) -> None:
    """Best effort: tell the peers that ``rank`` failed; the caller re-raises ``exc``."""
    _write_marker(remote, f"{work}/{layout.rank_failure_marker_name(rank, save_id)}", describe(exc))


def report_rank_skipped(
    remote: Backend, work: str, rank: int, save_id: str, superseded_by: str
) -> None:
    """Best effort: tell the peers that ``rank`` dropped this save for ``superseded_by``."""
    _write_marker(remote, f"{work}/{layout.rank_skip_marker_name(rank, save_id)}", superseded_by)


def report_commit_failure(remote: Backend, work: str, save_id: str, exc: BaseException) -> None:
    """Best effort: tell the peers that rank 0's commit failed; the caller re-raises ``exc``.

    A failure that names ranks (:class:`CommitError`) is written with them, so that the peers
    name the same ranks rather than rank 0, which only reports it."""
    text = describe(exc)
    if isinstance(exc, CommitError) and exc.failures:
        text = json.dumps({"error": text, "failures": exc.failures})
    _write_marker(remote, f"{work}/{layout.commit_failure_marker_name(save_id)}", text)


def raise_reported_failures(remote: Backend, work: str, save_id: str, name: str) -> set[str]:
    """Raise if a peer reported that save ``save_id`` of ``name`` failed or was skipped; else
    the entries of ``W/_ranks`` (names, not paths), for the caller's own checks.

    Raises:
        CommitError: ranks failed (naming each), or rank 0's commit failed.
        ReplicationSkippedError: a rank dropped this save for a newer one.
    """
    ranks_dir = f"{work}/{layout.RANKS_DIR}"
    present = set(remote.list_dir(ranks_dir))
    failed = _markers(present, lambda rank: layout.rank_failure_marker_name(rank, save_id))
    if failed:
        raise CommitError(
            "ranks failed to write or upload their part; nothing was published",
            {rank: _read_text(remote, f"{work}/{rel}") for rank, rel in failed},
        )
    skipped = _markers(present, lambda rank: layout.rank_skip_marker_name(rank, save_id))
    if skipped:
        raise ReplicationSkippedError(name, _read_text(remote, f"{work}/{skipped[0][1]}"))
    commit_failed = f"{work}/{layout.commit_failure_marker_name(save_id)}"
    if remote.exists(commit_failed):
        raise CommitError(
            "the remote commit failed; nothing was published",
            _reported_failures(_read_text(remote, commit_failed)),
        )
    return present


def _reported_failures(text: str) -> dict[int, str]:
    """The ranks a commit failure marker names (``{0: text}`` when it names none)."""
    with contextlib.suppress(ValueError):
        parsed = json.loads(text)
        failures = parsed.get("failures") if isinstance(parsed, dict) else None
        if isinstance(failures, dict) and failures and len(failures) <= 10_000:
            # Read from storage: keys must be ranks, values short text, nothing else.
            return {int(r): str(why)[:500] for r, why in failures.items() if str(r).isdigit()}
    return {0: text}


def await_arrivals(
    remote: Backend,
    work: str,
    save_id: str,
    name: str,
    world_size: int,
    options: UploadOptions,
) -> None:
    """Wait (rank 0), bounded, until every rank's remote rank manifest exists.

    Raises:
        CommitError, ReplicationSkippedError: a rank reported its failure or a skip.
        ReplicationTimeoutError: not every rank arrived within ``options.remote_timeout_s``.
    """
    manifests = {layout.rank_manifest_name(r).rpartition("/")[2]: r for r in range(world_size)}
    present: set[str] = set()

    def arrived() -> bool | None:
        present.clear()
        present.update(raise_reported_failures(remote, work, save_id, name))
        return True if manifests.keys() <= present else None

    try:
        options.poll(arrived, f"every rank's manifest under {remote.full_path(work)}")
    except ReplicationTimeoutError as exc:
        # Name the stalled ranks: rank 0 only reports them (its peers read this in the failure
        # marker), and blaming rank 0 would send whoever reads it to the wrong machine.
        missing = sorted(r for m, r in manifests.items() if m not in present)
        raise UploadTimeoutError(
            str(exc),
            dict.fromkeys(
                missing, f"did not upload its part within {options.remote_timeout_s:g} s"
            ),
        ) from exc


def await_remote_commit(
    remote: Backend,
    name: str,
    work: str,
    save_id: str,
    options: UploadOptions,
    *,
    before: Callable[[], None] = lambda: None,
) -> Manifest:
    """Wait, bounded by twice ``options.remote_timeout_s``, for ``name``'s remote commit: the
    remote manifest, once ``_COMMITTED`` names save ``save_id``. ``before`` is called first on
    every poll and raises to end the wait (rank 0's own outcome, run in this very process).

    Raises:
        CheckpointExistsError: another save committed ``name`` on the remote.
        CommitError, ReplicationSkippedError: a peer reported a failure or a skip.
        ReplicationTimeoutError: nothing happened by the deadline (chained to the last error
            opening the commit, a storage error when the store was unavailable).
    """

    def reported() -> None:
        # A storage error (StorageError included) ends no wait on its own: rank 0's commit may
        # retry through the outage and succeed.
        with contextlib.suppress(OSError):
            raise_reported_failures(remote, work, save_id, name)

    return await_committed(
        remote,
        name,
        timeout_s=2 * options.remote_timeout_s,
        pause_s=options.poll_s,
        save_id=save_id,
        before=before,
        between=reported,
    )


def _markers(present: set[str], name_for: Callable[[int], str]) -> list[tuple[int, str]]:
    """The ``(rank, path under the work location)`` of each entry of ``_ranks/`` that is the
    marker ``name_for(rank)`` spells for its own rank, lowest rank first."""
    ranks = {rank for rank in map(layout.rank_of_marker, present) if rank is not None}
    named = sorted((rank, name_for(rank)) for rank in ranks)
    return [(rank, rel) for rank, rel in named if rel.rpartition("/")[2] in present]


def _write_marker(remote: Backend, rel: str, text: str) -> None:
    # Best effort: the caller is raising the error that matters, and a peer that misses the
    # marker still stops at its deadline.
    with contextlib.suppress(Exception):
        remote.makedirs(posixpath.dirname(rel))  # a renaming remote's partial may not exist yet
        remote.write_bytes(rel, text.encode())


def _read_text(backend: Backend, rel: str) -> str:
    raw = backend.read_small(rel, CONTROL_MAX_BYTES)
    return raw.decode("utf-8", errors="replace").strip()
