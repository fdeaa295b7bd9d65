"""``export``: the one entry point, and the order of its steps.

Every check that can refuse an export runs before a byte of tensor data is read (destination,
marker, manifest, ``.metadata``, keys, dtypes); then tensors stream, a batch at a time, from the
verified reader into a hidden folder published whole (docs/export.md).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dcp_safe.choices import parse_choice, require_int
from dcp_safe.errors import ConfigError
from dcp_safe.exporting import formats
from dcp_safe.exporting.consolidate import Consolidator, parse_dtype, select
from dcp_safe.exporting.publish import CHECKSUMS, StagedExport, check_destination
from dcp_safe.topology import RootLike, as_root
from dcp_safe.units import format_bytes


class ExportFormat(str, enum.Enum):
    """What :func:`export` writes."""

    SAFETENSORS = "safetensors"  # model.safetensors, or shards + model.safetensors.index.json
    TORCH = "torch"  # one model.pt that torch.load(weights_only=True) loads


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote (docs/export.md, "Python API"): ``dest`` absolute, ``checkpoint``
    with ``"latest"`` resolved, ``files`` sorted (``SHA256SUMS`` included), ``tensor_bytes``
    after any cast, ``objects`` written (``format="torch"`` only), ``skipped`` with reasons."""

    dest: str
    format: ExportFormat
    checkpoint: str
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    objects: int = 0
    skipped: Mapping[str, str] = field(default_factory=dict)

    def summary(self) -> list[str]:
        """The result in a few lines, as ``dcp-safe export`` prints it."""
        objects = f", {self.objects} object(s)" if self.objects else ""
        files = ", ".join(self.files)
        return [
            f"exported {self.checkpoint} to {self.dest} as {self.format.value}: {self.tensors}"
            f" tensor(s), {format_bytes(self.tensor_bytes)}{objects}; files: {files}"
        ] + [f"skipped {key}: {why}" for key, why in sorted(self.skipped.items())]


def export(
    root: RootLike,
    name: str,
    dest: str | os.PathLike[str],
    *,
    format: ExportFormat | str = ExportFormat.SAFETENSORS,
    keys: Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = formats.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    signing_key: bytes | str | None = None,
) -> ExportResult:
    """Export committed checkpoint ``name`` under ``root`` to the new directory ``dest``.

    Tensors are written whole, flat by DCP's dotted key, in key order (docs/export.md says
    what each format holds).

    Args:
        name: the checkpoint's name, or ``"latest"``.
        dest: the directory to create (a local path).
        format: ``"safetensors"`` (non-tensor entries skipped) or ``"torch"`` (plain-data
            entries included).
        keys: entries to export, by full key or prefix (``"model"`` selects
            ``"model.layer.weight"``); ``None`` for all.
        dtype: cast floating tensors to this dtype (``torch.bfloat16`` or ``"bfloat16"``).
        max_shard_bytes: most tensor bytes per safetensors file (Hugging Face's 5 GB default);
            a larger tensor gets a file of its own.
        overwrite: replace an earlier export at ``dest`` (atomically).
        signing_key: accept only a checkpoint signed with this key.

    Raises:
        ConfigError: a bad option, a key the checkpoint lacks, a dtype the format cannot hold,
            nothing to export, or ``dest`` exists (and is not an export to overwrite).
        CheckpointNotFoundError: no such committed checkpoint.
        CheckpointCorruptError: any byte read does not match its checksum; nothing is written.
        StorageError: writing the output failed; nothing is left at ``dest``.
    """
    fmt = parse_choice(ExportFormat, format, "format")
    out_dtype = parse_dtype(dtype)
    require_int("max_shard_bytes", max_shard_bytes, 1)
    path = check_destination(dest, overwrite)
    source = Consolidator(as_root(root, storage_options), name, signing_key=signing_key)
    selection = select(source.metadata, keys, out_dtype, where=source.metadata_path)
    holds = formats.safetensors_holds if fmt is ExportFormat.SAFETENSORS else formats.torch_holds
    if refused := [entry for entry in selection.tensors if not holds(entry.out_dtype)]:
        dtypes = ", ".join(sorted({str(entry.out_dtype) for entry in refused}))
        why = f"format={fmt.value!r} cannot hold {dtypes} tensors"
        named = ", ".join(e.key for e in refused[:8])
        raise ConfigError(f"{why} ({named}); choose the other format or cast with dtype=")
    with StagedExport(path, overwrite=overwrite) as staged:
        if fmt is ExportFormat.SAFETENSORS:
            skipped = formats.write_safetensors(staged, source, selection, max_shard_bytes)
        else:
            skipped = formats.write_torch(staged, source, selection)
        staged.publish()
    return ExportResult(
        dest=staged.dest,
        format=fmt,
        checkpoint=source.name,
        files=tuple(sorted((*staged.digests, CHECKSUMS))),
        tensors=len(selection.tensors),
        tensor_bytes=sum(entry.out_nbytes for entry in selection.tensors),
        objects=len(selection.objects) - len(skipped),
        skipped=skipped,
    )
