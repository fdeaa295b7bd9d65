"""The policy layer: :class:`CheckpointManager` and the small parts it is made of."""

from __future__ import annotations

from dcp_safe.checkpoints.history import HISTORY_FILE
from dcp_safe.manager.handles import BusyPolicy, ManagerStats, SaveHandle, StagingMode, Validation
from dcp_safe.manager.manager import CheckpointManager
from dcp_safe.manager.options import Bounds, Resume, Retention, Runtime, SavePolicy
from dcp_safe.reading.safetensors_import import SafetensorsSource

__all__ = [
    "HISTORY_FILE",
    "Bounds",
    "BusyPolicy",
    "CheckpointManager",
    "ManagerStats",
    "Resume",
    "Retention",
    "Runtime",
    "SaveHandle",
    "SavePolicy",
    "SafetensorsSource",
    "StagingMode",
    "Validation",
]
