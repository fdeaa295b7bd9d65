"""``Publication``: one save's commit, made by the root's strategy, the same calls on every root.

Each test runs on a renaming root (a local directory) and on a marker root (``memory://``,
which publishes in place behind a writing lease), so what a caller sees does not depend on the
kind of root it holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.lease import Claimant, acquire_lease, lease_files
from dcp_safe.commit.strategy import Publication, strategy_for
from dcp_safe.errors import CheckpointExistsError, StaleWriterError

NAME = "step_1"


@pytest.fixture(params=["rename", "marker"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> Backend:
    return open_backend(str(tmp_path / "root") if request.param == "rename" else memory_root)


def _publication(backend: Backend, save_id: str | None = None) -> Publication:
    strategy = strategy_for(backend)
    return strategy.publication(backend, NAME, save_id or layout.new_save_id(), Claimant())


def _write(publication: Publication, rel: str = "__0_0.distcp") -> str:
    publication.backend.makedirs(publication.work_dir)
    publication.backend.write_bytes(f"{publication.work_dir}/{rel}", b"shard")
    return rel


def test_claim_write_publish_makes_a_committed_checkpoint_and_leaves_no_claim(
    backend: Backend,
) -> None:
    publication = _publication(backend)
    publication.claim()
    _write(publication)
    publication.publish(b"digest", files={layout.MANIFEST: b"{}"})
    assert backend.read_bytes(f"{NAME}/{layout.COMMITTED_MARKER}") == b"digest"
    assert backend.read_bytes(f"{NAME}/__0_0.distcp") == b"shard"
    assert lease_files(backend, NAME) == []
    assert not any(layout.is_partial_entry(e) for e in backend.list_dir(""))


def test_a_committed_name_is_refused_at_the_claim_before_a_byte_is_written(
    backend: Backend,
) -> None:
    first = _publication(backend)
    first.claim()
    _write(first)
    first.publish(b"digest", files={})
    with pytest.raises(CheckpointExistsError):
        _publication(backend).claim()


def test_a_save_that_lost_its_lease_publishes_nothing(memory_root: str) -> None:
    backend = open_backend(memory_root)
    ours = _publication(backend)
    ours.claim()
    _write(ours)
    # Another save took the name over (a newer attempt): ours stops at its next check.
    backend.remove_file(f"{NAME}/{layout.lease_file_name()}")
    acquire_lease(backend, NAME, "newer")
    with pytest.raises(StaleWriterError):
        ours.check()
    with pytest.raises(StaleWriterError):
        ours.publish(b"digest", files={})
    assert not backend.exists(f"{NAME}/{layout.COMMITTED_MARKER}")


def test_a_failed_publish_discards_what_the_save_wrote(backend: Backend) -> None:
    publication = _publication(backend)
    publication.claim()
    _write(publication)
    publication.discard(OSError("the manifest write failed"))
    assert not backend.exists(f"{publication.work_dir}/__0_0.distcp")
    assert lease_files(backend, NAME) == []
    _publication(backend).claim()  # the name is free again


def test_a_lone_rank_that_failed_abandons_its_files_and_frees_the_name(backend: Backend) -> None:
    publication = _publication(backend)
    publication.claim()
    own = _write(publication)
    publication.abandon([own], shared=False)
    if not backend.supports_atomic_rename:
        assert not backend.exists(f"{NAME}/{own}")
    assert lease_files(backend, NAME) == []
    _publication(backend).claim()


def test_a_rank_with_peers_marks_the_claim_abandoned_for_the_next_save_to_take_over(
    memory_root: str,
) -> None:
    backend = open_backend(memory_root)
    failed = _publication(backend)
    failed.claim()
    own = _write(failed)
    peer = _write(failed, "__1_0.distcp")
    failed.abandon([own], shared=True)
    assert not backend.exists(f"{NAME}/{own}")
    assert backend.exists(f"{NAME}/{peer}")  # a peer's files stay for the takeover to clear
    taker = _publication(backend)
    taker.claim()  # no CheckpointExistsError: an abandoned claim is taken over
    assert not backend.exists(f"{NAME}/{peer}")
