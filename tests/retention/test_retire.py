"""Retiring a checkpoint (its publish strategy's ``retire``) unpublishes it before deleting
anything it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import make_state

import dcp_safe
from dcp_safe import SafeStorageWriter, list_checkpoints
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.strategy import strategy_for


class _Interrupted(Exception):
    pass


def _save(root: str | Path, name: str) -> Backend:
    writer = SafeStorageWriter(root)
    dcp_safe.save(make_state(1), checkpoint_id=name, storage_writer=writer)
    return writer.backend


def _fail_bulk_deletes(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the process died once the checkpoint was unpublished, before its files were gone:
    # removing a whole directory fails, removing one file (the marker) still works.
    remove_tree = backend.remove_tree

    def interrupted(rel: str) -> None:
        if "/" in rel:
            remove_tree(rel)
        else:
            raise _Interrupted(rel)

    monkeypatch.setattr(backend, "remove_tree", interrupted)


def test_retiring_removes_the_checkpoint_and_leaves_nothing_behind(tmp_path: Path) -> None:
    backend = _save(tmp_path, "step_1")
    _save(tmp_path, "step_2")
    strategy_for(backend).retire(backend, "step_1")
    assert [info.name for info in list_checkpoints(tmp_path)] == ["step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_a_retirement_interrupted_on_posix_leaves_only_a_hidden_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _save(tmp_path, "step_1")
    _fail_bulk_deletes(backend, monkeypatch)
    with pytest.raises(_Interrupted):
        strategy_for(backend).retire(backend, "step_1")
    assert list_checkpoints(tmp_path) == []
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".step_1.partial-")  # the sweeper's to collect


def test_a_retirement_interrupted_on_an_object_store_leaves_nothing_listed(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _save(memory_root, "step_1")
    assert not backend.supports_atomic_rename
    _fail_bulk_deletes(backend, monkeypatch)
    with pytest.raises(_Interrupted):
        strategy_for(backend).retire(backend, "step_1")
    assert list_checkpoints(memory_root) == []
