"""The policy layer: :class:`CheckpointManager` and the small parts it is made of."""

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
