"""dcp_safe: a safe backend for PyTorch Distributed Checkpoint.

See DESIGN (docs/architecture.md) for how a save flows; the public names are listed in
``__all__`` and a test keeps that list honest.
"""

from __future__ import annotations

__version__ = "0.1.0"

from dcp_safe.errors import (
    AdmissionTimeoutError,
    BudgetExceededError,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    DcpSafeError,
    InvalidCheckpointNameError,
    StaleWriterError,
    StorageError,
)

__all__ = [
    "AdmissionTimeoutError",
    "BudgetExceededError",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "DcpSafeError",
    "InvalidCheckpointNameError",
    "StaleWriterError",
    "StorageError",
    "__version__",
]
