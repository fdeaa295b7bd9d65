"""A restore that proves itself: the live tensors, after a load, against what was saved.

Every rank fingerprints the pieces it holds (:mod:`dcp_safe.reading.audit`), all ranks exchange
them, and each compares the sums with those recorded at save: the same verdict everywhere.
See docs/resume.md, "A restore that proves itself".
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from dcp_safe import layout
from dcp_safe.dcp.planners import SafeLoadPlanner
from dcp_safe.errors import ConfigError, RestoreMismatchError
from dcp_safe.reading import audit
from dcp_safe.untrusted import shown

__all__ = ["audit_load"]

log = logging.getLogger(__name__)


def audit_load(planner: SafeLoadPlanner, group: Any) -> None:
    """Check the tensors ``planner`` just loaded against the checkpoint's fingerprints.

    Call order: on every rank, right after the load, on the group the load used (``None``: a
    single process). Tensors the checkpoint has no fingerprints for are listed in
    ``report.unaudited`` and logged as a warning (on rank 0).

    Raises:
        ConfigError: the checkpoint was saved without fingerprints.
        RestoreMismatchError: the live state differs (on every rank, with the same list).
    """
    metadata = planner.metadata
    saved = (metadata.planner_data or {}).get(layout.AUDIT_KEY) if metadata else None
    name = planner.report.name or "the checkpoint"
    if not isinstance(saved, dict):
        raise ConfigError(
            f"{name} has no fingerprints to audit against (saved without dcp_safe's planner,"
            " or with record_audit=False); load it without audit=True"
        )
    rank = dist.get_rank(group) if group is not None else 0
    mine = audit.report(planner.state_dict, rank)
    if group is None:
        reports = [mine]
    else:
        reports = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(reports, mine, group=group)
    found = audit.mismatches(saved, reports)
    if found:
        raise RestoreMismatchError(name, found)
    loaded = {k for one in reports for k in one}
    planner.report.audited = tuple(sorted(loaded & saved.keys()))
    planner.report.unaudited = tuple(sorted(loaded - saved.keys()))
    if planner.report.unaudited and rank == 0:  # the same list on every rank: said once
        log.warning(
            "audit of %s: %d restored tensor(s) were not checked, the checkpoint has no"
            " fingerprints for them (a save records them for every tensor: these were cut"
            " from its metadata, or saved as something else): %s",
            shown(name),
            len(planner.report.unaudited),
            shown(", ".join(planner.report.unaudited), 400),
        )
