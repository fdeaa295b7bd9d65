"""Editing a committed checkpoint as anyone who can write its root can."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dcp_safe import layout
from dcp_safe.manifest.schema import manifest_digest


def resign_manifest(root: Any, name: str, edit: Any) -> None:
    """Rewrite ``<root>/<name>/manifest.json`` with ``edit(raw_dict)`` applied, and the marker
    to match: what anyone who can write the root can do (checksums are no defence)."""
    folder = Path(root) / name
    raw = json.loads((folder / layout.MANIFEST).read_bytes())
    edit(raw)
    data = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    (folder / layout.MANIFEST).write_bytes(data)
    (folder / layout.COMMITTED_MARKER).write_bytes(manifest_digest(data).encode())
