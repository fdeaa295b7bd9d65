"""What ``CheckpointManager.restore`` loads, from where, and what it reports.

The coordinator resolves the name once while every rank waits in rounds, so a commit or prune
meanwhile cannot split the ranks. The manager's own tiers come first; another run's
(``initial_load_from``) only when they hold no committed checkpoint at all; with a signing
key, every reader here holds it, the warm start's too. Every restore is
recorded in the history (``restored``, with where it came from). Keys and the report:
docs/resume.md.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from dcp_safe import layout
from dcp_safe.adapters import api
from dcp_safe.adapters.planners import RestoreReport, SafeLoadPlanner
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.checkpoints.catalog import list_checkpoints
from dcp_safe.coordination.agreement import Agreement
from dcp_safe.coordination.groups import FOREGROUND
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError, SignatureError
from dcp_safe.manager.ledger import Ledger
from dcp_safe.manager.saving import SaveRunner
from dcp_safe.manager.tiers import Tiers
from dcp_safe.topology import Root

__all__ = ["Restorer", "WarmStart"]


@dataclass(frozen=True)
class WarmStart:
    """Another run's checkpoints to start from when the manager's own roots hold none.

    Attributes:
        source: a root (its newest committed checkpoint) or ``ROOT/NAME`` (that checkpoint),
            with its fsspec options.
        keys: restore only these key prefixes (``None``: every key the state dict asks for).
    """

    source: Root
    keys: tuple[str, ...] | None = None

    def resolve(self, signing_key: bytes | None) -> tuple[str, str]:
        """``(root, name)`` of the checkpoint to start from: with ``signing_key`` (the
        manager's), only one it signed counts, as for the manager's own checkpoints.

        Raises:
            SignatureError: with a key, ``source`` holds committed checkpoints, none signed
                with it (``UnsignedCheckpointError``: the one named is not signed at all).
            CheckpointNotFoundError: ``source`` holds no committed checkpoint.
        """
        refused: dict[str, CheckpointCorruptError] = {}

        def listed(url: str) -> list[str]:
            found = list_checkpoints(
                dataclasses.replace(self.source, url=url),
                signing_key=signing_key,
                on_damaged=refused.__setitem__,
            )
            return [c.name for c in found]

        found = listed(self.source.url)
        if found:
            return self.source.url, found[-1]
        root, name = posixpath.split(self.source.url.rstrip("/"))
        if root and name in listed(root):
            return root, name
        # Say why, not "nothing there": a checkpoint the key did not sign is not a warm start.
        refusals = (refused.get(name), *refused.values())
        signature = next((e for e in refusals if isinstance(e, SignatureError)), None)
        if signature is not None:
            raise signature
        raise CheckpointNotFoundError(self.source.url, "no committed checkpoint to warm-start from")


@dataclass(kw_only=True, eq=False)
class Restorer:
    """Restores for one manager.

    Args:
        runner: the manager's save runner (its foreground group carries loads too).
        wait_s: how long the ranks wait for the coordinator to resolve the checkpoint.
        deferred: a context in which a preemption signal waits.
    """

    tiers: Tiers
    agreement: Agreement
    runner: SaveRunner
    ledger: Ledger
    per_rank: tuple[str, ...]
    warm_start: WarmStart | None
    wait_s: float
    deferred: Callable[[], Any]
    name_for: Callable[[int], str]
    last_reader: SafeStorageReader | None = field(default=None, init=False)

    def restore(
        self,
        state_dict: dict[str, Any],
        step: int | str,
        *,
        keys: Collection[str] | None,
        exclude: Sequence[str],
        allow_partial: bool,
        audit: bool = False,
    ) -> RestoreReport:
        """Load step ``step``'s checkpoint (or ``"latest"``) into ``state_dict``.

        Raises:
            CheckpointNotFoundError: nothing committed by that name (nor to warm-start from).
            CheckpointCorruptError: the bytes do not match their manifest on any tier.
            MissingKeysError: keys asked for are not in the checkpoint (without allow_partial).
            PerRankStateError: per-rank entries were saved by another world size.
            RestoreMismatchError: ``audit`` found the live state differs from the saved one.
            LoadError: a rank's load failed (a shape that does not match, say), cause named.
        """
        wanted = step if step == layout.LATEST else self.name_for(int(step))
        number = -1 if step == layout.LATEST else int(step)
        own = self.tiers.reader()

        def resolve() -> tuple[str | None, str]:
            try:
                own.reset(wanted)
                return None, str(own.checkpoint_id)
            except CheckpointNotFoundError:
                if self.warm_start is None or wanted != layout.LATEST:
                    raise
                if self.tiers.latest("local") is not None:  # the own tiers hold one
                    raise
                return self.warm_start.resolve(self.tiers.signing_key)

        with self.deferred():
            source, name = self.agreement.settle("restore", number, resolve, self.wait_s)
            if source is None:
                reader, where, tier = own, "this run", "local"
            else:
                assert self.warm_start is not None
                reader = SafeStorageReader(
                    dataclasses.replace(self.warm_start.source, url=source),
                    load_budget_bytes=self.tiers.load_budget_bytes,
                    signing_key=self.tiers.signing_key,
                )
                # The URL as given (credentials travel in options, never in it), shortened.
                where, tier = f"warm start from {source[:300]}", "initial"
                keys = keys if keys is not None else self.warm_start.keys
            self.last_reader = reader
            planner = SafeLoadPlanner(
                per_rank=self.per_rank,
                keys=keys,
                exclude=exclude,
                allow_partial=allow_partial,
                name=name,
            )
            with (
                self.tiers.reading(name if source is None else None),
                self.runner.collectives(FOREGROUND) as collectives,
            ):
                api.load(
                    state_dict,
                    checkpoint_id=name,
                    storage_reader=reader,
                    planner=planner,
                    audit=audit,
                    **collectives,
                )
        report = planner.report
        self.ledger.record("restored", (None, name), tier=tier, reason=_reason(where, report))
        return report


def _reason(where: str, report: RestoreReport) -> str:
    parts = [where, f"{len(report.restored)} keys restored"]
    if report.skipped:
        parts.append(f"{len(report.skipped)} skipped on request")
    if report.missing:
        parts.append(f"{len(report.missing)} missing, left as they were")
    return "; ".join(parts)
