"""The writing lease on storage without atomic rename (``memory://`` here; S3 in its own tests)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.history import History
from dcp_safe.commit import lease
from dcp_safe.commit.lease import (
    acquire_lease,
    check_lease,
    held_by_another,
    holds_lease,
    release_lease,
)
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import CheckpointExistsError, StaleWriterError


@pytest.fixture
def root(memory_root: str) -> str:
    return memory_root


def test_a_save_without_rename_commits_and_releases_its_lease(root: str) -> None:
    state = make_state(1)
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    backend = open_backend(root)
    assert backend.exists(f"step_1/{layout.COMMITTED_MARKER}")
    assert not backend.exists(f"step_1/{layout.WRITING_LEASE}")
    target = blank_like(state)
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=SafeStorageReader(root))
    assert_state_equal(target, state)
    dcp_safe.verify_checkpoint(root, "step_1")


def test_a_held_lease_refuses_a_second_save_before_it_writes(root: str) -> None:
    backend = open_backend(root)
    acquire_lease(backend, "step_1", "other-save")
    with pytest.raises(CheckpointExistsError, match="other-save"):
        dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    assert backend.list_dir("step_1") == [layout.WRITING_LEASE]


def test_a_writer_whose_lease_was_taken_over_cannot_publish(root: str) -> None:
    class _LosesItsLease(SafeStorageWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            self.backend.write_bytes(f"step_1/{layout.WRITING_LEASE}", b'{"save_id": "newer"}')
            super().finish(metadata, results)

    with pytest.raises(StaleWriterError):
        dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=_LosesItsLease(root))
    backend = open_backend(root)
    assert not backend.exists(f"step_1/{layout.COMMITTED_MARKER}")
    with pytest.raises(StaleWriterError):
        check_lease(backend, "step_1", "mine")


def test_a_writer_whose_lease_was_taken_writes_no_control_file(root: str) -> None:
    """The new holder's ``.metadata`` and ``manifest.json`` must never be overwritten by a
    writer that lost the name: it stops at the lease check, before writing them (#17)."""
    written: list[str] = []

    class _LosesItsLease(SafeStorageWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            self.backend.write_bytes(f"step_1/{layout.WRITING_LEASE}", b'{"save_id": "newer"}')
            original = self.backend.write_bytes

            def record(rel: str, data: bytes, *, exclusive: bool = False) -> None:
                written.append(rel)
                original(rel, data, exclusive=exclusive)

            self.backend.write_bytes = record  # type: ignore[method-assign]
            super().finish(metadata, results)

    with pytest.raises(StaleWriterError):
        dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=_LosesItsLease(root))
    assert written == []
    backend = open_backend(root)
    for control in (layout.DCP_METADATA, layout.MANIFEST, layout.COMMITTED_MARKER):
        assert not backend.exists(f"step_1/{control}")


def test_a_failed_publish_removes_its_own_objects(root: str) -> None:
    class _FailsAtMarker(SafeStorageWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            original = self.backend.write_bytes

            def fail(rel: str, data: bytes, *, exclusive: bool = False) -> None:
                if rel.endswith(layout.COMMITTED_MARKER):
                    raise dcp_safe.StorageError("put", rel, "injected")
                original(rel, data, exclusive=exclusive)

            self.backend.write_bytes = fail  # type: ignore[method-assign]
            super().finish(metadata, results)

    with pytest.raises(dcp_safe.StorageError):
        dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=_FailsAtMarker(root))
    assert not open_backend(root).exists("step_1")
    dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    assert [c.name for c in dcp_safe.list_checkpoints(root)] == ["step_1"]


# ------------------------------------------------------- storage without exclusive create


@pytest.fixture
def per_save(root: str) -> Backend:
    """A root whose backend says it has no exclusive create: one lease per save."""
    backend = open_backend(root)
    backend.supports_exclusive_create = False
    return backend


def test_a_per_save_lease_is_taken_checked_and_released(per_save: Backend) -> None:
    acquire_lease(per_save, "step_1", "mine")
    assert per_save.list_dir("step_1") == [layout.lease_file_name("mine")]
    check_lease(per_save, "step_1", "mine")
    with pytest.raises(StaleWriterError):
        check_lease(per_save, "step_1", "other")
    release_lease(per_save, "step_1", "mine")
    assert per_save.list_dir("step_1") == []


def test_a_lease_that_stays_refuses_the_name_and_leaves_nothing_of_ours(per_save: Backend) -> None:
    acquire_lease(per_save, "step_1", "other-save")
    started = time.monotonic()
    with pytest.raises(CheckpointExistsError, match="other-save"):
        acquire_lease(per_save, "step_1", "mine")
    assert time.monotonic() - started < 2  # two looks, not every round
    assert per_save.list_dir("step_1") == [layout.lease_file_name("other-save")]


def test_a_contender_that_withdraws_leaves_the_name_to_the_next_round(
    per_save: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    contender = f"step_1/{layout.lease_file_name('contender')}"
    per_save.write_bytes(contender, b"{}")
    monkeypatch.setattr(lease, "_pause", lambda: per_save.remove_file(contender))
    acquire_lease(per_save, "step_1", "mine")
    assert per_save.list_dir("step_1") == [layout.lease_file_name("mine")]


def test_a_contender_seen_again_but_retrying_is_not_taken_for_a_holder(
    per_save: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two racers that keep retrying at the same moments see each other round after round;
    neither may give up on that, or the name ends with no winner. Only a lease unchanged since
    the last round is a holder's."""
    contender = f"step_1/{layout.lease_file_name('contender')}"
    retries = [True, True, False]  # in our pauses: it writes its lease anew twice, then gives up

    def contender_retries() -> None:
        if retries.pop(0):
            time.sleep(0.01)  # a new acquired_at
            per_save.write_bytes(contender, json.dumps({"acquired_at": time.time()}).encode())
        else:
            per_save.remove_file(contender)

    per_save.write_bytes(contender, json.dumps({"acquired_at": time.time()}).encode())
    monkeypatch.setattr(lease, "_pause", contender_retries)
    acquire_lease(per_save, "step_1", "mine")
    assert per_save.list_dir("step_1") == [layout.lease_file_name("mine")]


def test_a_committed_name_is_refused_with_no_lease_left(per_save: Backend) -> None:
    per_save.write_bytes(f"step_1/{layout.COMMITTED_MARKER}", b"digest")
    with pytest.raises(CheckpointExistsError):
        acquire_lease(per_save, "step_1", "mine")
    assert per_save.list_dir("step_1") == [layout.COMMITTED_MARKER]


def test_a_save_without_exclusive_create_commits_and_releases_its_lease(root: str) -> None:
    class _PerSave(SafeStorageWriter):
        def __init__(self, root: str) -> None:
            super().__init__(root)
            self.backend.supports_exclusive_create = False

    state = make_state(2)
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=_PerSave(root))
    assert not [e for e in open_backend(root).list_dir("step_1") if layout.is_lease_file(e)]
    with pytest.raises(CheckpointExistsError):
        dcp_safe.save(state, checkpoint_id="step_1", storage_writer=_PerSave(root))
    target = blank_like(state)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=SafeStorageReader(root))
    assert_state_equal(target, state)


def test_a_failed_save_clears_its_files_but_not_a_contenders_new_lease(
    per_save: Backend, tmp_path: Any
) -> None:
    acquire_lease(per_save, "step_1", "mine")
    for member in ("__0_0.distcp", layout.DCP_METADATA, "_ranks/rank_00000.json"):
        per_save.write_bytes(f"step_1/{member}", b"x")
    # Another save writes its lease while this one is failing; it will take the name next.
    per_save.write_bytes(f"step_1/{layout.lease_file_name('next')}", b"{}")
    publication = strategy_for(per_save).publication(per_save, "step_1", "mine")
    publication.discard(OSError("the marker write failed"))
    assert sorted(per_save.walk_files("step_1")) == [layout.lease_file_name("next")]


# ------------------------------------------------------- replication: the same save id shares


@pytest.fixture(params=[True, False], ids=["exclusive", "per_save"])
def either(root: str, request: pytest.FixtureRequest) -> Backend:
    """A root with either lease kind."""
    backend = open_backend(root)
    backend.supports_exclusive_create = bool(request.param)
    return backend


def _lease_of(backend: Backend, save_id: str) -> str:
    return layout.lease_file_name(None if backend.supports_exclusive_create else save_id)


def test_a_lease_of_the_same_save_is_joined_and_one_of_another_is_refused(
    either: Backend,
) -> None:
    assert acquire_lease(either, "step_1", "mine", join=True) is False  # taken
    assert acquire_lease(either, "step_1", "mine", join=True) is True  # joined
    assert holds_lease(either, "step_1", "mine")
    assert not held_by_another(either, "step_1", "mine")
    with pytest.raises(CheckpointExistsError, match="mine"):
        acquire_lease(either, "step_1", "other", join=True)
    assert held_by_another(either, "step_1", "other")
    assert either.list_dir("step_1") == [_lease_of(either, "mine")]


def test_a_local_save_never_joins_an_exclusive_lease_even_of_its_own_save_id(root: str) -> None:
    """(A local save's id is fresh for each save, so with per-save leases the same key cannot
    already be there; only the exclusive lease could be mistaken for its own.)"""
    backend = open_backend(root)
    acquire_lease(backend, "step_1", "mine", join=True)
    with pytest.raises(CheckpointExistsError):
        acquire_lease(backend, "step_1", "mine")
    assert backend.list_dir("step_1") == [layout.WRITING_LEASE]


def test_a_committed_name_is_refused_to_a_joiner_too(either: Backend) -> None:
    acquire_lease(either, "step_1", "mine", join=True)
    either.write_bytes(f"step_1/{layout.COMMITTED_MARKER}", b"digest")
    with pytest.raises(CheckpointExistsError):
        acquire_lease(either, "step_1", "mine", join=True)
    assert sorted(either.list_dir("step_1")) == sorted(
        [layout.COMMITTED_MARKER, _lease_of(either, "mine")]  # the co-holder's, left alone
    )


def test_a_per_save_lease_beside_another_saves_is_not_joined_nor_removed(
    per_save: Backend,
) -> None:
    """Two leases side by side: a contention round is under way, and ours may be the
    co-holder's, which must not be withdrawn by a joiner."""
    for save_id in ("mine", "other"):
        per_save.write_bytes(f"step_1/{layout.lease_file_name(save_id)}", b"{}")
    with pytest.raises(CheckpointExistsError, match="other"):
        acquire_lease(per_save, "step_1", "mine", join=True)
    assert per_save.list_dir("step_1") == sorted(
        layout.lease_file_name(save_id) for save_id in ("mine", "other")
    )


# What a planted lease says reaches the refusal, and from there a log line and a history event:
# terminal escapes, a line break, and a shell substitution for a history that became a script.
_PLANTED_ID = "\x1b]0;pwned\x07\x1b[2J\n$(touch /tmp/dcp-safe-pwned)"


def test_a_planted_lease_s_text_never_reaches_a_message_or_an_event(root: str) -> None:
    backend = open_backend(root)
    body = json.dumps({"save_id": _PLANTED_ID, "acquired_at": time.time()}).encode()
    backend.write_bytes(f"step_1/{layout.WRITING_LEASE}", body)
    with pytest.raises(CheckpointExistsError) as caught:
        dcp_safe.save(make_state(1), checkpoint_id="step_1", storage_writer=SafeStorageWriter(root))
    message = str(caught.value)
    assert "save None is writing it" in message
    assert "pwned" not in message and "\x1b" not in message and "\n" not in message
    with pytest.raises(StaleWriterError) as lost:
        check_lease(backend, "step_1", "mine")
    assert "pwned" not in str(lost.value)

    history = History(backend)
    history.append("failed", 1, "step_1", reason=f"CheckpointExistsError: {_PLANTED_ID}")
    [event] = history.read()
    assert not set(event["reason"]) & {"\x1b", "\x07", "\n"}
    assert "\\x1b]0;pwned\\x07" in event["reason"]
