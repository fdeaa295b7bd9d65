"""dcp_safe: a safe backend for PyTorch Distributed Checkpoint.

See DESIGN (docs/architecture.md) for how a save flows. ``__all__`` is what the README and the
examples teach (tests/test_public_api.py keeps it at most 45 names, each in the docs): every
other exception is in ``dcp_safe.errors``, the reports, enums and protocols public signatures
name are in ``dcp_safe.api_types`` (and the manager's, stager's, telemetry's and export's parts
in those packages); docs/manager.md lists where each name that left the root lives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    DcpSafeError,
    StorageError,
)
from dcp_safe.version import __version__

if TYPE_CHECKING:  # the same names, for type checkers; at run time __getattr__ imports them
    from dcp_safe.adapters.api import async_save, load, save, translate_errors
    from dcp_safe.adapters.node_local import NodeLocalOptions, NodeLocalWriter
    from dcp_safe.adapters.options import WriterOptions
    from dcp_safe.adapters.planners import SafeLoadPlanner, SafeSavePlanner
    from dcp_safe.adapters.reader import SafeStorageReader
    from dcp_safe.adapters.writer import SafeStorageWriter
    from dcp_safe.backends.retry import RetryPolicy
    from dcp_safe.checkpoints.adopt import adopt
    from dcp_safe.checkpoints.catalog import list_checkpoints, verify_checkpoint
    from dcp_safe.coordination.group import checkpoint_group
    from dcp_safe.exporting import export
    from dcp_safe.manager import Bounds, CheckpointManager, Resume, Retention, Runtime, SavePolicy
    from dcp_safe.manager.fallback import FallbackOptions
    from dcp_safe.replication.rank_upload import UploadOptions
    from dcp_safe.retention.apply import apply_retention
    from dcp_safe.retention.sweeper import sweep_partials
    from dcp_safe.staging import BudgetedStager, MemoryBudget, StagerOptions
    from dcp_safe.topology import Root, Topology

# Imported on first use (PEP 562), so that what needs only part of dcp_safe (``dcp-safe ls``,
# ``history``, ``show``) does not pay for torch's import: name -> the module that defines it.
_LAZY = {
    "async_save": "dcp_safe.adapters.api",
    "load": "dcp_safe.adapters.api",
    "save": "dcp_safe.adapters.api",
    "translate_errors": "dcp_safe.adapters.api",
    "NodeLocalOptions": "dcp_safe.adapters.node_local",
    "NodeLocalWriter": "dcp_safe.adapters.node_local",
    "WriterOptions": "dcp_safe.adapters.options",
    "SafeLoadPlanner": "dcp_safe.adapters.planners",
    "SafeSavePlanner": "dcp_safe.adapters.planners",
    "SafeStorageReader": "dcp_safe.adapters.reader",
    "SafeStorageWriter": "dcp_safe.adapters.writer",
    "RetryPolicy": "dcp_safe.backends.retry",
    "adopt": "dcp_safe.checkpoints.adopt",
    "list_checkpoints": "dcp_safe.checkpoints.catalog",
    "verify_checkpoint": "dcp_safe.checkpoints.catalog",
    "checkpoint_group": "dcp_safe.coordination.group",
    "export": "dcp_safe.exporting",
    "Bounds": "dcp_safe.manager",
    "CheckpointManager": "dcp_safe.manager",
    "Resume": "dcp_safe.manager",
    "Retention": "dcp_safe.manager",
    "Runtime": "dcp_safe.manager",
    "SavePolicy": "dcp_safe.manager",
    "FallbackOptions": "dcp_safe.manager.fallback",
    "UploadOptions": "dcp_safe.replication.rank_upload",
    "apply_retention": "dcp_safe.retention.apply",
    "sweep_partials": "dcp_safe.retention.sweeper",
    "BudgetedStager": "dcp_safe.staging",
    "MemoryBudget": "dcp_safe.staging",
    "StagerOptions": "dcp_safe.staging",
    "Root": "dcp_safe.topology",
    "Topology": "dcp_safe.topology",
}

__all__ = [
    # the policy layer and its option values
    "CheckpointManager",
    "SavePolicy",
    "Retention",
    "Bounds",
    "Resume",
    "Runtime",
    "FallbackOptions",
    "Topology",
    "Root",
    # DCP's interfaces, their options and the wrappers
    "SafeStorageWriter",
    "SafeStorageReader",
    "WriterOptions",
    "RetryPolicy",
    "UploadOptions",
    "NodeLocalWriter",
    "NodeLocalOptions",
    "SafeSavePlanner",
    "SafeLoadPlanner",
    "BudgetedStager",
    "StagerOptions",
    "MemoryBudget",
    "save",
    "load",
    "async_save",
    "translate_errors",
    "checkpoint_group",
    # what is on storage
    "list_checkpoints",
    "verify_checkpoint",
    "export",
    "adopt",
    "apply_retention",
    "sweep_partials",
    # the errors a training loop catches (the rest: dcp_safe.errors)
    "DcpSafeError",
    "ConfigError",
    "CommitError",
    "StorageError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "__version__",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_safe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
