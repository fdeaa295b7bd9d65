"""``open_committed`` parses a manifest's bytes once: the same bytes, read again, give the same
``Manifest``; a changed manifest is hashed, checked against its marker and parsed anew.

Each prune lists every checkpoint and each commit's check opens it once more: at 10,000 items a
parse is ~0.2 s of Python on the manager's thread, which shares the interpreter with training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import make_state, resign_manifest

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageWriter, layout
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.manifest.schema import Manifest


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``Manifest.from_json`` parses from now on."""
    seen: list[str] = []
    parse = Manifest.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, data: bytes, path: str) -> Any:
        seen.append(path)
        return parse(cls, data, path)

    monkeypatch.setattr(Manifest, "from_json", classmethod(counting))
    return seen


def _saved(root: Path, name: str, step: int) -> None:
    writer = SafeStorageWriter(root, fsync=False, step=step)
    dcp_safe.save(make_state(step), checkpoint_id=name, storage_writer=writer)


def test_the_same_manifest_bytes_are_parsed_once(tmp_path: Path, parses: list[str]) -> None:
    _saved(tmp_path, "step_0001", 1)
    backend = LocalBackend(str(tmp_path))
    first = open_committed(backend, "step_0001")
    again = open_committed(backend, "step_0001")
    assert len(parses) == 1
    assert again.manifest is first.manifest and again.digest == first.digest
    # Listing (what every prune does) reuses it too.
    assert [info.name for info in dcp_safe.list_checkpoints(tmp_path)] == ["step_0001"]
    assert len(parses) == 1


def test_a_changed_manifest_is_checked_and_parsed_anew(tmp_path: Path, parses: list[str]) -> None:
    _saved(tmp_path, "step_0001", 1)
    backend = LocalBackend(str(tmp_path))
    before = open_committed(backend, "step_0001")
    # Rewritten with a matching marker (anyone who can write the root can): other bytes, so
    # the parse is not the remembered one.
    resign_manifest(tmp_path, "step_0001", lambda raw: raw.update(step=7))
    after = open_committed(backend, "step_0001")
    assert len(parses) == 2
    assert (before.manifest.step, after.manifest.step) == (1, 7)


def test_a_remembered_manifest_is_still_refused_when_its_marker_disagrees(
    tmp_path: Path, parses: list[str]
) -> None:
    _saved(tmp_path, "step_0001", 1)
    backend = LocalBackend(str(tmp_path))
    open_committed(backend, "step_0001")
    (tmp_path / "step_0001" / layout.COMMITTED_MARKER).write_bytes(b"sha256:" + b"0" * 64)
    with pytest.raises(CheckpointCorruptError, match="does not match the digest"):
        open_committed(backend, "step_0001")


def test_the_same_bytes_under_another_name_are_refused(tmp_path: Path, parses: list[str]) -> None:
    _saved(tmp_path, "step_0001", 1)
    backend = LocalBackend(str(tmp_path))
    open_committed(backend, "step_0001")
    copy = tmp_path / "step_0002"
    copy.mkdir()
    for name in (layout.MANIFEST, layout.COMMITTED_MARKER):
        (copy / name).write_bytes((tmp_path / "step_0001" / name).read_bytes())
    with pytest.raises(CheckpointCorruptError, match="manifest names another checkpoint"):
        open_committed(backend, "step_0002")
