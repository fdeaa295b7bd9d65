"""The publish strategy: chosen once from the backend, and the commit point where it says.

Real backends: a local directory (atomic rename) and ``memory://`` (marker only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.strategy import MarkerStrategy, RenameStrategy, strategy_for


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> Backend:
    return open_backend(str(tmp_path) if request.param == "local" else memory_root)


def _stage(backend: Backend, work_dir: str) -> None:
    backend.makedirs(work_dir)
    backend.write_bytes(f"{work_dir}/data.bin", b"payload")


def test_the_strategy_follows_the_backends_capability(tmp_path: Path, memory_root: str) -> None:
    assert isinstance(strategy_for(open_backend(str(tmp_path))), RenameStrategy)
    assert isinstance(strategy_for(open_backend(memory_root)), MarkerStrategy)
    assert strategy_for(open_backend(memory_root)).in_place
    assert strategy_for(open_backend(str(tmp_path))).can_replace


def test_publish_makes_the_work_a_checkpoint_with_its_marker_last(backend: Backend) -> None:
    strategy = strategy_for(backend)
    work_dir = strategy.work_dir("step_1", "abc")
    _stage(backend, work_dir)
    seen: list[bool] = []

    def before_commit() -> None:  # at the commit point, nothing is published yet
        seen.append(backend.exists(f"step_1/{layout.COMMITTED_MARKER}"))

    strategy.publish(backend, work_dir, "step_1", b"digest", before_commit=before_commit)

    assert seen == [False]
    assert backend.read_bytes(f"step_1/{layout.COMMITTED_MARKER}") == b"digest"
    assert backend.read_bytes("step_1/data.bin") == b"payload"
    assert not strategy.in_place or work_dir == "step_1"


def test_a_refusal_at_the_commit_point_publishes_nothing(backend: Backend) -> None:
    strategy = strategy_for(backend)
    work_dir = strategy.work_dir("step_1", "abc")
    _stage(backend, work_dir)

    def stale() -> None:
        raise RuntimeError("fenced")

    with pytest.raises(RuntimeError, match="fenced"):
        strategy.publish(backend, work_dir, "step_1", b"digest", before_commit=stale)
    assert not backend.exists(f"step_1/{layout.COMMITTED_MARKER}")


def test_a_committed_name_is_never_published_over(backend: Backend) -> None:
    strategy = strategy_for(backend)
    first = strategy.work_dir("step_1", "first")
    _stage(backend, first)
    strategy.publish(backend, first, "step_1", b"one")
    second = strategy.work_dir("step_1", "second")
    if strategy.in_place:
        second = "step_1"  # object stores: the second save writes into the same prefix
    else:
        _stage(backend, second)

    with pytest.raises(FileExistsError):
        strategy.publish(backend, second, "step_1", b"two")
    assert backend.read_bytes(f"step_1/{layout.COMMITTED_MARKER}") == b"one"


def test_retire_unpublishes_then_deletes(backend: Backend) -> None:
    strategy = strategy_for(backend)
    work_dir = strategy.work_dir("step_1", "abc")
    _stage(backend, work_dir)
    strategy.publish(backend, work_dir, "step_1", b"digest")

    strategy.retire(backend, "step_1")

    assert not backend.exists(f"step_1/{layout.COMMITTED_MARKER}")
    assert not backend.exists("step_1/data.bin")
