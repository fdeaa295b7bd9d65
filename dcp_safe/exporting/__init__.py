"""Export: a committed checkpoint as consolidated safetensors or one ``torch.save`` file.

See :func:`export` and docs/export.md.
"""

from __future__ import annotations

from dcp_safe.exporting.api import ExportFormat, ExportResult, export
from dcp_safe.exporting.formats import DEFAULT_MAX_SHARD_BYTES

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportFormat", "ExportResult", "export"]
