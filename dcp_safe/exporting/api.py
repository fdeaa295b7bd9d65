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

from dcp_safe.choices import parse_choice
from dcp_safe.errors import ConfigError, StorageError
from dcp_safe.exporting import safetensors_format as st
from dcp_safe.exporting import torch_format
from dcp_safe.exporting.consolidate import Consolidator, NotPlainData
from dcp_safe.exporting.publish import CHECKSUMS, StagedExport, check_destination
from dcp_safe.exporting.selection import Selection, TensorEntry, parse_dtype, select
from dcp_safe.exporting.sink import write_tensor
from dcp_safe.topology import RootLike, as_root
from dcp_safe.units import format_bytes

__all__ = ["ExportFormat", "ExportResult", "export"]


class ExportFormat(str, enum.Enum):
    """What :func:`export` writes."""

    SAFETENSORS = "safetensors"  # model.safetensors, or shards + model.safetensors.index.json
    TORCH = "torch"  # one model.pt that torch.load(weights_only=True) loads


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        dest: the directory now holding the export (absolute).
        checkpoint: the exported checkpoint's name (``"latest"`` resolved).
        files: the files in ``dest``, sorted (``SHA256SUMS`` included).
        tensor_bytes: bytes of tensor data written (after any cast).
        objects: non-tensor entries written (``format="torch"`` only).
        skipped: selected entries that were not written, each with the reason.
    """

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
        lines = [
            f"exported {self.checkpoint} to {self.dest} as {self.format.value}: {self.tensors}"
            f" tensor(s), {format_bytes(self.tensor_bytes)}"
            + (f", {self.objects} object(s)" if self.objects else "")
            + f"; files: {', '.join(self.files)}"
        ]
        lines += [f"skipped {key}: {why}" for key, why in sorted(self.skipped.items())]
        return lines


def export(
    root: RootLike,
    name: str,
    dest: str | os.PathLike[str],
    *,
    format: ExportFormat | str = ExportFormat.SAFETENSORS,
    keys: Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = st.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    signing_key: bytes | str | None = None,
) -> ExportResult:
    """Export committed checkpoint ``name`` under ``root`` to the new directory ``dest``.

    Tensors are written whole, flat by DCP's dotted key, in key order (docs/export.md says
    what each format holds).

    Args:
        root: the checkpoint root (a directory, an fsspec URL, or a
            :class:`~dcp_safe.topology.Root` with its fsspec options).
        storage_options: fsspec options of a URL ``root`` (a shorthand of ``Root``).
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
    st.check_max_shard_bytes(max_shard_bytes)
    check_destination(dest, overwrite)
    source = Consolidator(as_root(root, storage_options), name, signing_key=signing_key)
    selection = select(source.metadata, keys, out_dtype, where=source.metadata_path)
    if fmt is ExportFormat.SAFETENSORS:
        return _safetensors(source, selection, dest, max_shard_bytes, overwrite)
    return _torch(source, selection, dest, overwrite)


def _refuse_dtypes(
    unsupported: list[str], fmt: ExportFormat, tensors: Sequence[TensorEntry]
) -> None:
    if unsupported:
        refused = set(unsupported)
        dtypes = {str(e.out_dtype) for e in tensors if e.key in refused}
        raise ConfigError(
            f"format={fmt.value!r} cannot hold {', '.join(sorted(dtypes))} tensors"
            f" ({', '.join(unsupported[:8])}); choose the other format or cast with dtype="
        )


def _safetensors(
    source: Consolidator,
    selection: Selection,
    dest: str | os.PathLike[str],
    max_shard_bytes: int,
    overwrite: bool,
) -> ExportResult:
    fmt = ExportFormat.SAFETENSORS
    _refuse_dtypes(st.unsupported(selection.tensors), fmt, selection.tensors)
    if not selection.tensors:
        raise ConfigError("nothing to export: the selected entries hold no tensors")
    shards = st.plan_shards(selection.tensors, max_shard_bytes)
    files = dict(zip(st.shard_names(len(shards)), shards, strict=True))
    metadata = {"format": "pt", "source": f"dcp_safe checkpoint {source.name}"}
    with StagedExport(dest, overwrite=overwrite) as staged:
        for file_name, entries in files.items():
            header = st.encode_header(entries, metadata)
            with staged.open(file_name) as sink:
                sink.write(header)
                source.each_tensor(entries, lambda e, t: write_tensor(sink, t, e.out_dtype))
                if sink.tell() != len(header) + st.data_bytes(entries):
                    raise StorageError("write", staged.path(file_name), "size is off")
            st.check_file(staged.path(file_name), entries)
        if len(files) > 1:
            with staged.open(st.INDEX_NAME) as sink:
                sink.write(st.encode_index(files))
        staged.publish()
    skipped = dict.fromkeys(selection.objects, "not a tensor (safetensors holds tensors only)")
    return _result(staged, fmt, source, selection, 0, skipped)


def _torch(
    source: Consolidator,
    selection: Selection,
    dest: str | os.PathLike[str],
    overwrite: bool,
) -> ExportResult:
    fmt = ExportFormat.TORCH
    _refuse_dtypes(torch_format.unsupported(selection.tensors), fmt, selection.tensors)
    plain: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for key, value in source.objects(selection.objects).items():
        if isinstance(value, NotPlainData):
            skipped[key] = value.reason
        elif not torch_format.is_plain(value):
            skipped[key] = f"not plain data ({type(value).__name__})"
        else:
            plain[key] = value
    if not selection.tensors and not plain:
        raise ConfigError("nothing to export: the selection holds no tensors and no plain data")
    with StagedExport(dest, overwrite=overwrite) as staged:
        with (
            staged.open(torch_format.FILE_NAME) as sink,
            torch_format.TorchFileWriter(sink, selection.tensors, plain) as writer,
        ):
            source.each_tensor(selection.tensors, writer.add)
        torch_format.check_file(staged.path(torch_format.FILE_NAME), selection.tensors, plain)
        staged.publish()
    return _result(staged, fmt, source, selection, len(plain), skipped)


def _result(
    staged: StagedExport,
    fmt: ExportFormat,
    source: Consolidator,
    selection: Selection,
    objects: int,
    skipped: dict[str, str],
) -> ExportResult:
    return ExportResult(
        dest=staged.dest,
        format=fmt,
        checkpoint=source.name,
        files=tuple(sorted((*staged.files, CHECKSUMS))),
        tensors=len(selection.tensors),
        tensor_bytes=sum(entry.out_nbytes for entry in selection.tensors),
        objects=objects,
        skipped=skipped,
    )
