"""Export: a committed checkpoint as consolidated safetensors or one ``torch.save`` file.

For serving and fine-tuning tools that read Hugging Face safetensors or a plain state dict
rather than DCP's sharded layout. Read verified, written tensor by tensor, published atomically
with a ``SHA256SUMS``; see :func:`export` and docs/export.md. It sits at the policy layer: it
reads through :mod:`dcp_safe.dcp`'s reader and writes through :mod:`dcp_safe.backends`.
"""

from __future__ import annotations

from dcp_safe.exporting.api import ExportFormat, ExportResult, export
from dcp_safe.exporting.safetensors_format import DEFAULT_MAX_SHARD_BYTES

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportFormat", "ExportResult", "export"]
