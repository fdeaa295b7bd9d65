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
