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
    name: module
    for module, names in {
        "dcp_safe.adapters.api": "async_save load save translate_errors",
        "dcp_safe.adapters.node_local": "NodeLocalOptions NodeLocalWriter",
        "dcp_safe.adapters.options": "WriterOptions",
        "dcp_safe.adapters.planners": "SafeLoadPlanner SafeSavePlanner",
        "dcp_safe.adapters.reader": "SafeStorageReader",
        "dcp_safe.adapters.writer": "SafeStorageWriter",
        "dcp_safe.backends.retry": "RetryPolicy",
        "dcp_safe.checkpoints.adopt": "adopt",
        "dcp_safe.checkpoints.catalog": "list_checkpoints verify_checkpoint",
        "dcp_safe.coordination.group": "checkpoint_group",
        "dcp_safe.exporting": "export",
        "dcp_safe.manager": "Bounds CheckpointManager Resume Retention Runtime SavePolicy",
        "dcp_safe.manager.fallback": "FallbackOptions",
        "dcp_safe.replication.rank_upload": "UploadOptions",
        "dcp_safe.retention.apply": "apply_retention",
        "dcp_safe.retention.sweeper": "sweep_partials",
        "dcp_safe.staging": "BudgetedStager MemoryBudget StagerOptions",
        "dcp_safe.topology": "Root Topology",
    }.items()
    for name in names.split()
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
