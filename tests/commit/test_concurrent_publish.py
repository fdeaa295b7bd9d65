"""Two saves of one name at once, on storage with and without a real exclusive create.

The interleaving is forced, the worst one every time: racer 0 writes its lease, then racer 1
(so both leases are on storage before either looks), and racer 0 is the slower writer (so,
were both let through, its shards would land after racer 1's marker). Whatever the storage:
exactly one save commits, the other gets a typed error, and the committed checkpoint verifies
and loads bit for bit. ``If-None-Match`` is stripped by the fault proxy to
stand for an S3-compatible server that ignores it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import CommitError, SafeStorageReader, SafeStorageWriter, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.errors import CheckpointExistsError
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy

Options = dict[str, Any] | None


class _Racer(SafeStorageWriter):
    """Racer ``who`` of two: lease writes in order (0, then 1), then both go on; 0 is slower."""

    def __init__(
        self, root: str, options: Options, who: int, tried: list[threading.Event], **kw: Any
    ) -> None:
        super().__init__(root, storage_options=options)
        self._who, self._tried = who, tried
        if kw.get("exclusive") is not None:
            self.backend.supports_exclusive_create = kw["exclusive"]

    def prepare_global_plan(self, plans: Any) -> Any:
        backend = self.backend
        original = backend.write_bytes
        waited = False

        def write_bytes(rel: str, data: bytes, *, exclusive: bool = False) -> None:
            nonlocal waited
            first = not waited and layout.is_lease_file(rel.rsplit("/", 1)[-1])
            if first and self._who == 1:
                self._tried[0].wait(timeout=20)
            try:
                original(rel, data, exclusive=exclusive)
            finally:
                if first:
                    waited = True
                    self._tried[self._who].set()
                    self._tried[1 - self._who].wait(timeout=20)

        backend.write_bytes = write_bytes  # type: ignore[method-assign]
        try:
            return super().prepare_global_plan(plans)
        finally:
            del backend.write_bytes

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._who == 0:
            time.sleep(0.5)
        return super().write_data(plan, planner)


def _race(root: str, options: Options, *, exclusive: bool | None = None) -> None:
    states = {0: make_state(30), 1: make_state(31)}
    tried = [threading.Event(), threading.Event()]
    outcomes: dict[int, BaseException | None] = {}

    def publish(who: int) -> None:
        try:  # the writer too: its backend probes the server, and a failure there is an outcome
            writer = _Racer(root, options, who, tried, exclusive=exclusive)
            dcp_safe.save(states[who], checkpoint_id="step_1", storage_writer=writer)
            outcomes[who] = None
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            outcomes[who] = exc

    threads = [threading.Thread(target=publish, args=(who,)) for who in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    winners = [who for who, error in outcomes.items() if error is None]
    assert len(winners) == 1, outcomes
    (loser,) = [error for error in outcomes.values() if error is not None]
    assert isinstance(loser, (CheckpointExistsError, CommitError)), repr(loser)
    dcp_safe.verify_checkpoint(root, "step_1", storage_options=options)
    winner = states[winners[0]]
    target = blank_like(winner)
    reader = SafeStorageReader(root, storage_options=options)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert_state_equal(target, winner)
    left = open_backend(root, options).list_dir("step_1")
    assert not [entry for entry in left if layout.is_lease_file(entry)], left


def test_memory_root_has_a_real_exclusive_create_and_one_winner(memory_root: str) -> None:
    assert open_backend(memory_root).supports_exclusive_create
    _race(memory_root, None)


def test_without_exclusive_create_per_save_leases_give_one_winner(memory_root: str) -> None:
    _race(memory_root, None, exclusive=False)


@pytest.fixture
def ignoring_server(s3: LocalS3, s3_root: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """An S3 root behind a proxy that drops ``If-None-Match`` from every PUT."""
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.strip_header("If-None-Match", method="PUT")
        yield s3_root, proxy.storage_options()


@pytest.mark.s3
def test_a_server_that_ignores_if_none_match_is_detected(
    ignoring_server: tuple[str, dict[str, Any]], s3_root: str, s3_options: dict[str, Any]
) -> None:
    root, options = ignoring_server
    assert not open_backend(root, options).supports_exclusive_create
    assert open_backend(s3_root, s3_options).supports_exclusive_create
    assert open_backend(root, options).list_dir("") == []  # the probe cleaned up


@pytest.mark.s3
def test_racing_saves_on_a_server_that_ignores_if_none_match_give_one_winner(
    ignoring_server: tuple[str, dict[str, Any]],
) -> None:
    root, options = ignoring_server
    _race(root, options)


@pytest.mark.s3
def test_racing_saves_on_s3_with_conditional_writes_give_one_winner(
    s3_root: str, s3_options: dict[str, Any]
) -> None:
    _race(s3_root, s3_options)
