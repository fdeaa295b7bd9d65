"""The policy layer: :class:`CheckpointManager` and the small parts it is made of.

``manager`` is the facade a training loop calls; ``handles`` its modes, handle and counters;
``slot`` is the single-flight slot the busy policies decide about; ``tiers`` is retention,
listing and restore on the local and remote roots; ``spans`` its telemetry;
``fallback`` decides when to return to synchronous saves; ``preemption`` turns SIGTERM into a
final save.
"""

from __future__ import annotations

from dcp_safe.checkpoints.history import HISTORY_FILE
from dcp_safe.manager.handles import (
    BusyPolicy,
    ManagerStats,
    SaveHandle,
    StagingMode,
    Validation,
)
from dcp_safe.manager.manager import CheckpointManager

__all__ = [
    "HISTORY_FILE",
    "BusyPolicy",
    "CheckpointManager",
    "ManagerStats",
    "SaveHandle",
    "StagingMode",
    "Validation",
]
