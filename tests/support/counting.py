"""Counting what a test says must (not) happen in this process."""

from __future__ import annotations

from typing import Any

import pytest

from dcp_safe.manifest.schema import Manifest


def manifest_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``Manifest.from_json`` parses in this process from now on (not in workers)."""
    seen: list[str] = []
    parse = Manifest.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, data: bytes, path: str) -> Any:
        seen.append(path)
        return parse(cls, data, path)

    monkeypatch.setattr(Manifest, "from_json", classmethod(counting))
    return seen
