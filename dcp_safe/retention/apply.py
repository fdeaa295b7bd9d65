"""Apply retention to a root: drop what the policy lets go, then sweep abandoned partial saves.

The one pass ``dcp-safe gc`` makes, from :func:`~dcp_safe.retention.policy.decide` (pure) and
:func:`~dcp_safe.retention.sweeper.sweep_partials` (the IO, with its grace period). Checkpoints
without a step (not saved by a manager) are left alone. One that cannot be retired is passed by
with a warning; a later pass tries again. With a signing key only checkpoints it signed count:
an unsigned or damaged one is neither kept nor dropped (it never pushes a signed one out), but
left in place and reported (``not_counted``), for a person to look at.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.catalog import list_checkpoints
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import CheckpointCorruptError, DcpSafeError
from dcp_safe.retention.policy import CheckpointRecord, KeepLast, decide
from dcp_safe.retention.sweeper import (
    DEFAULT_GRACE_S,
    SweepReport,
    open_sweepable,
    sweep_partials,
    sweep_trash,
)
from dcp_safe.topology import RootLike, as_root
from dcp_safe.untrusted import shown

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RetentionReport:
    """What :func:`apply_retention` did (or, in a dry run, would do); names oldest first.
    ``not_counted``: committed names left in place and out of the count: damaged, or not signed
    with the key (planted by someone without it, or another job's). ``trash``: what the expiry
    of the trash removed and left (``None``: not asked for)."""

    kept: tuple[str, ...]
    dropped: tuple[str, ...]
    sweep: SweepReport
    dry_run: bool
    not_counted: tuple[str, ...] = ()
    trash: SweepReport | None = None


def apply_retention(
    root: RootLike,
    *,
    keep_last: int,
    dry_run: bool = False,
    grace_s: float = DEFAULT_GRACE_S,
    storage_options: dict[str, Any] | None = None,
    allow_bucket_root: bool = False,
    signing_key: bytes | str | None = None,
    trash_grace_s: float | None = None,
) -> RetentionReport:
    """Keep the ``keep_last`` newest checkpoints under ``root`` and sweep old partial saves.

    The safety rules of :func:`~dcp_safe.retention.policy.decide` apply on top of
    ``keep_last``: whatever it says, the two newest checkpoints are kept.

    Args:
        dry_run: report what would be removed; remove nothing.
        grace_s: leave partial saves idle for less than this many seconds.
        allow_bucket_root: work on a root that is a whole bucket (refused otherwise: the
            sweep there could touch other applications' objects).
        signing_key: count only checkpoints signed with this key (default
            ``DCP_SAFE_SIGNING_KEY`` if set), as a signing manager's own retention does.
        trash_grace_s: also delete what the trash holds past this many seconds
            (:func:`~dcp_safe.retention.sweeper.sweep_trash`); dropped checkpoints are deleted
            at once either way.

    Raises:
        ConfigError: a negative ``keep_last`` or ``grace_s``, or a bucket root without
            ``allow_bucket_root``; nothing is removed.
    """
    policy = KeepLast(keep_last)  # refused before anything is read
    root = as_root(root, storage_options)
    backend = open_sweepable(root, grace_s, allow_bucket_root=allow_bucket_root)
    not_counted: list[str] = []

    def passed_by(name: str, exc: CheckpointCorruptError) -> None:
        not_counted.append(name)
        log.warning("not counted, left in place: %s (%s)", shown(name), shown(exc, 300))

    infos = list_checkpoints(root, on_damaged=passed_by, signing_key=signing_key)
    # Every listed checkpoint's marker matches its manifest: committed counts as validated here.
    records = [CheckpointRecord(i.name, i.step, True) for i in infos if i.step is not None]
    decision = decide(records, policy)
    dropped = decision.drop if dry_run else tuple(n for n in decision.drop if _retired(backend, n))
    sweep = sweep_partials(
        root, grace_s=grace_s, dry_run=dry_run, allow_bucket_root=allow_bucket_root
    )
    trash = None if trash_grace_s is None else sweep_trash(backend, trash_grace_s, dry_run=dry_run)
    return RetentionReport(
        kept=decision.keep,
        dropped=dropped,
        sweep=sweep,
        dry_run=dry_run,
        not_counted=tuple(not_counted),
        trash=trash,
    )


def _retired(backend: Backend, name: str) -> bool:
    """Retire ``name``; a failure is a warning, and one that left it published keeps it listed
    (a damaged checkpoint never stops the rest of the pass: the next one tries again)."""
    try:
        # Unpublished in one step first, so a crash half-way never leaves a broken one listed.
        strategy_for(backend).retire(backend, name)
    except (DcpSafeError, OSError) as exc:
        log.warning("retiring %s failed: %s", shown(backend.full_path(name)), shown(exc, 300))
        try:
            return not backend.exists(f"{name}/{layout.COMMITTED_MARKER}")
        except OSError:  # cannot tell: counted as still published, as Tiers does
            return False
    return True
