"""dcp_safe: a safe backend for PyTorch Distributed Checkpoint.

See DESIGN (docs/architecture.md) for how a save flows; the public names are listed in
``__all__`` and a test keeps that list honest.
"""

from __future__ import annotations

from dcp_safe.checkpoints.catalog import (
    CheckpointInfo,
    VerifyReport,
    list_checkpoints,
    verify_checkpoint,
)
from dcp_safe.checkpoints.node_cache import NodeCache, list_node_caches
from dcp_safe.dcp.api import async_save, load, save
from dcp_safe.dcp.for_topology import writer_for
from dcp_safe.dcp.group import checkpoint_group
from dcp_safe.dcp.node_local import NodeLocalOptions, NodeLocalWriter
from dcp_safe.dcp.options import WriterOptions
from dcp_safe.dcp.planners import RestoreReport, SafeLoadPlanner, SafeSavePlanner
from dcp_safe.dcp.reader import SafeStorageReader
from dcp_safe.dcp.writer import SafeStorageWriter
from dcp_safe.errors import (
    AdmissionTimeoutError,
    BudgetExceededError,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    DcpSafeError,
    DivergentStateError,
    DrainTimeoutError,
    InvalidCheckpointNameError,
    LoadError,
    MissingKeysError,
    PeerCopyError,
    PerRankStateError,
    ReplicationSkippedError,
    ReplicationTimeoutError,
    RestoreMismatchError,
    RollbackUnavailableError,
    SignatureError,
    SnapshotMutatedError,
    StaleWriterError,
    StorageError,
    UnsafeCheckpointError,
    UnsignedCheckpointError,
    UploadTimeoutError,
    WorkerDiedError,
    WorkerError,
)
from dcp_safe.exporting import ExportResult, export
from dcp_safe.manager import (
    Bounds,
    BusyPolicy,
    CheckpointManager,
    ManagerStats,
    Resume,
    Retention,
    Runtime,
    SaveHandle,
    SavePolicy,
    StagingMode,
    Validation,
)
from dcp_safe.manager.fallback import FallbackOptions
from dcp_safe.retention.apply import RetentionReport, apply_retention
from dcp_safe.retention.sweeper import SweepReport, sweep_partials
from dcp_safe.staging import (
    BudgetedStager,
    CapacityPlan,
    Generation,
    MemoryBudget,
    StagerOptions,
    StagerStats,
    WhenBusy,
    plan_capacity,
)
from dcp_safe.telemetry import MemorySampler, Telemetry
from dcp_safe.topology import Root, Topology
from dcp_safe.version import __version__

__all__ = [
    "AdmissionTimeoutError",
    "BudgetExceededError",
    "Bounds",
    "BudgetedStager",
    "BusyPolicy",
    "CapacityPlan",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "DcpSafeError",
    "DivergentStateError",
    "DrainTimeoutError",
    "ExportResult",
    "FallbackOptions",
    "Generation",
    "InvalidCheckpointNameError",
    "LoadError",
    "ManagerStats",
    "MissingKeysError",
    "MemoryBudget",
    "MemorySampler",
    "NodeCache",
    "NodeLocalOptions",
    "NodeLocalWriter",
    "PeerCopyError",
    "PerRankStateError",
    "ReplicationSkippedError",
    "ReplicationTimeoutError",
    "UploadTimeoutError",
    "WorkerDiedError",
    "WorkerError",
    "RestoreMismatchError",
    "RollbackUnavailableError",
    "RestoreReport",
    "Resume",
    "Retention",
    "Runtime",
    "SavePolicy",
    "RetentionReport",
    "Root",
    "SafeLoadPlanner",
    "SafeSavePlanner",
    "SafeStorageReader",
    "SafeStorageWriter",
    "SaveHandle",
    "StagerOptions",
    "StagerStats",
    "SignatureError",
    "SnapshotMutatedError",
    "StaleWriterError",
    "StagingMode",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsignedCheckpointError",
    "SweepReport",
    "Telemetry",
    "Topology",
    "Validation",
    "VerifyReport",
    "WhenBusy",
    "WriterOptions",
    "__version__",
    "apply_retention",
    "async_save",
    "checkpoint_group",
    "export",
    "list_checkpoints",
    "list_node_caches",
    "load",
    "plan_capacity",
    "save",
    "sweep_partials",
    "verify_checkpoint",
    "writer_for",
]
