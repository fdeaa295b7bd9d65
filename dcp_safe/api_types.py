"""The types public signatures name that ``dcp_safe`` itself does not export.

The reports public calls return, the enums their options take and the protocols they accept.
A training loop seldom names them, so they stay out of the package root (tests/test_public_api.py
keeps it small); importing them from here rather than from the module that defines them keeps a
user's import working while the package's insides move.
"""

from __future__ import annotations

from dcp_safe.adapters.broadcast import SentObjects
from dcp_safe.adapters.options import Compression
from dcp_safe.adapters.planners import RestoreReport
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.adopt import AdoptReport
from dcp_safe.checkpoints.catalog import CheckpointInfo, VerifyReport
from dcp_safe.manager.preemption import PreemptionHandler
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.schema import FileRecord
from dcp_safe.observe import StagerObserver
from dcp_safe.reading.budget import LoadMemoryStats
from dcp_safe.reading.sources import NodeCacheStats
from dcp_safe.retention.apply import RetentionReport
from dcp_safe.retention.policy import RetentionPolicy
from dcp_safe.retention.sweeper import SweepReport
from dcp_safe.staging.plan import StagedStateDict

__all__ = [
    "AdoptReport",
    "Backend",
    "CheckpointInfo",
    "ChecksumAlgorithm",
    "Compression",
    "FileRecord",
    "LoadMemoryStats",
    "NodeCacheStats",
    "PreemptionHandler",
    "RestoreReport",
    "RetentionPolicy",
    "RetentionReport",
    "SentObjects",
    "StagedStateDict",
    "StagerObserver",
    "SweepReport",
    "VerifyReport",
]
