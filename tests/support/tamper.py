"""Editing a committed checkpoint as anyone who can write its root can."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dcp_safe import layout
from dcp_safe.manifest.schema import Manifest, manifest_digest


def resign_manifest(root: Any, name: str, edit: Any) -> None:
    """Rewrite ``<root>/<name>/manifest.json`` with ``edit(raw_dict)`` applied, and the marker
    to match: what anyone who can write the root can do (checksums are no defence)."""
    folder = Path(root) / name
    raw = json.loads((folder / layout.MANIFEST).read_bytes())
    edit(raw)
    data = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    (folder / layout.MANIFEST).write_bytes(data)
    (folder / layout.COMMITTED_MARKER).write_bytes(manifest_digest(data).encode())


def claim_item_length(root: Any, name: str, length: int, rows: int | None = None) -> None:
    """Save one float32 item of 16 x 8 as ``name``, then say it is ``length`` bytes long (its
    file too) and, with ``rows``, the one chunk of a tensor of ``rows`` x 8: a checkpoint of
    a few KiB that declares what it does not hold."""
    import torch

    import dcp_safe

    dcp_safe.save(
        {"w": torch.randn(16, 8)},
        checkpoint_id=name,
        storage_writer=dcp_safe.SafeStorageWriter(
            root, options=dcp_safe.WriterOptions(fsync=False), step=1
        ),
    )

    def edit(raw: dict[str, Any]) -> None:
        (item,) = raw["items"]
        item["length"] = length
        for record in raw["files"]:
            if record["path"] == item["file"]:
                record["size"] = length
        if rows is not None:
            ((_, entry),) = raw["dcp_metadata"]["entries"]
            entry["size"] = [rows, 8]
            entry["chunks"] = [[[0, 0], [rows, 8]]]

    resign_manifest(root, name, edit)


def flip_item_byte(root: Any, name: str, fqn: str) -> None:
    """Flip one byte in the middle of the stored bytes of ``fqn`` (its first item), leaving
    manifest and marker alone: what a bad disk or a partial overwrite does."""
    folder = Path(root) / name
    manifest_path = folder / layout.MANIFEST
    manifest = Manifest.from_json(manifest_path.read_bytes(), str(manifest_path))
    record = next(item for item in manifest.items if item.fqn == fqn)
    path = folder / record.file
    data = bytearray(path.read_bytes())
    data[record.start + record.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
