"""``open_committed`` parses a manifest's bytes once: the same bytes, read again, give the same
``Manifest``; a changed manifest is hashed, checked against its marker and parsed anew.

Each prune lists every checkpoint and each commit's check opens it once more: at 10,000 items a
parse is ~0.2 s of Python on the manager's thread, which shares the interpreter with training.
Listings need only a manifest's header, kept far longer by digest (``open_header``), and given by
the checkpoint worker for a checkpoint it checked (``remember_header``): the same checks on
fresh reads, no parse.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import make_state, manifest_parses, resign_manifest

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.checkpoints import committed
from dcp_safe.checkpoints.committed import (
    CommittedHeader,
    open_committed,
    open_header,
    remember_header,
)
from dcp_safe.manifest.schema import Manifest


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``Manifest.from_json`` parses from now on."""
    return manifest_parses(monkeypatch)


@pytest.fixture
def forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has parsed and remembered nothing yet."""
    monkeypatch.setattr(committed, "_parsed", committed._Kept[Manifest](4))
    monkeypatch.setattr(committed, "_headers", committed._Kept[CommittedHeader](1024))


def _saved(root: Path, name: str, step: int) -> None:
    writer = SafeStorageWriter(root, options=WriterOptions(fsync=False), step=step)
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


def test_listings_keep_headers_after_the_parsed_manifest_is_dropped(
    tmp_path: Path, parses: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path, "step_0001", 1)
    backend = LocalBackend(str(tmp_path))
    opened = open_committed(backend, "step_0001")
    monkeypatch.setattr(committed, "_parsed", committed._Kept[Manifest](4))  # crowded out
    header, digest = open_header(backend, "step_0001")
    assert len(parses) == 1
    assert digest == opened.digest
    assert header == CommittedHeader.of(opened.manifest)
    assert (header.step, header.total_bytes) == (1, opened.manifest.total_bytes)
    [info] = dcp_safe.list_checkpoints(tmp_path)
    assert (info.name, info.step, info.save_id) == ("step_0001", 1, opened.manifest.save_id)
    assert committed.resolve_name(backend, "latest") == "step_0001"
    assert len(parses) == 1


def test_a_header_remembered_from_elsewhere_lists_without_a_parse(
    tmp_path: Path, forgotten: None, parses: list[str]
) -> None:
    # As the checkpoint worker reports a checkpoint it checked: its digest and header.
    _saved(tmp_path, "step_0001", 1)
    backend = LocalBackend(str(tmp_path))
    raw = (tmp_path / "step_0001" / layout.MANIFEST).read_bytes()
    manifest = Manifest.from_json(raw, "m")
    digest = (tmp_path / "step_0001" / layout.COMMITTED_MARKER).read_text().strip()
    parses.clear()
    remember_header(digest, CommittedHeader.of(manifest))
    assert [info.step for info in dcp_safe.list_checkpoints(tmp_path)] == [1]
    assert parses == []
    # The marker is still read and checked on every listing.
    (tmp_path / "step_0001" / layout.COMMITTED_MARKER).write_bytes(b"sha256:" + b"0" * 64)
    assert dcp_safe.list_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointCorruptError, match="does not match the digest"):
        open_header(backend, "step_0001")


def test_a_listing_sees_a_rewritten_manifest_not_the_remembered_header(
    tmp_path: Path, parses: list[str]
) -> None:
    _saved(tmp_path, "step_0001", 1)
    assert [info.step for info in dcp_safe.list_checkpoints(tmp_path)] == [1]
    resign_manifest(tmp_path, "step_0001", lambda raw: raw.update(step=7))
    assert [info.step for info in dcp_safe.list_checkpoints(tmp_path)] == [7]
    assert len(parses) == 2


def test_a_remembered_header_does_not_list_a_copy_under_another_name(
    tmp_path: Path, parses: list[str]
) -> None:
    _saved(tmp_path, "step_0001", 1)
    assert len(dcp_safe.list_checkpoints(tmp_path)) == 1
    copy = tmp_path / "step_0002"
    copy.mkdir()
    for name in (layout.MANIFEST, layout.COMMITTED_MARKER):
        (copy / name).write_bytes((tmp_path / "step_0001" / name).read_bytes())
    assert [info.name for info in dcp_safe.list_checkpoints(tmp_path)] == ["step_0001"]
    with pytest.raises(CheckpointCorruptError, match="manifest names another checkpoint"):
        open_header(LocalBackend(str(tmp_path)), "step_0002")
