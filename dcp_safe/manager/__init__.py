"""The policy layer: :class:`CheckpointManager` and the small parts it is made of.

``manager`` is the facade a training loop calls; ``slot`` is the single-flight slot and its
busy policies; ``tiers`` is retention, listing and restore on the local and remote roots;
``fallback`` decides when to return to synchronous saves; ``preemption`` turns SIGTERM into a
final save.
"""

from __future__ import annotations

from dcp_safe.checkpoints.history import HISTORY_FILE
from dcp_safe.manager.manager import (
    BusyPolicy,
    CheckpointManager,
    ManagerStats,
    SaveHandle,
    StagingMode,
    Validation,
)

__all__ = [
    "HISTORY_FILE",
    "BusyPolicy",
    "CheckpointManager",
    "ManagerStats",
    "SaveHandle",
    "StagingMode",
    "Validation",
]
