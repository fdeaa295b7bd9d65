"""A restarted job (a newer attempt) takes over the writing lease a killed attempt left (#26).

Real saves on ``memory://`` (with its exclusive create, and with one lease per save) and on S3
(moto server). A killed writer is simulated in process by a writer that dies at the end of
``write_data`` with nothing of its clean-up run (what SIGKILL leaves), and once on S3 by a real
process killed with SIGKILL inside ``write_data`` while a shard's multipart upload is open.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import (
    CheckpointManager,
    SafeStorageReader,
    SafeStorageWriter,
    Topology,
    WriterOptions,
    layout,
)
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.checkpoints.history import History
from dcp_safe.commit.fencing import ATTEMPT_ENV, RUN_ID_ENV, Attempt, register_attempt
from dcp_safe.commit.lease import Claimant, abandon_lease, acquire_lease, check_lease, read_holder
from dcp_safe.errors import CheckpointExistsError, StaleWriterError
from dcp_safe.testing.multiproc import run_ranks

# Only a guard against a hung test, never a measure of speed.
_TIMEOUT_S = 60.0
THREE_FILES = WriterOptions(thread_count=3)  # a save that leaves three shard files behind


@pytest.fixture(autouse=True)
def _no_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


@dataclass(frozen=True)
class Root:
    """A root without atomic rename, and the lease kind its writers use."""

    url: str
    options: dict[str, Any] | None = None
    exclusive: bool = True

    def writer(self, cls: type[SafeStorageWriter] = SafeStorageWriter, **kwargs: Any) -> Any:
        writer = cls(self.url, storage_options=self.options, **kwargs)
        writer.backend.supports_exclusive_create = self.exclusive
        return writer

    def backend(self) -> Backend:
        backend = open_backend(self.url, self.options)
        backend.supports_exclusive_create = self.exclusive
        return backend


@pytest.fixture(params=["exclusive", "per_save", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, memory_root: str) -> Root:
    if request.param == "s3":
        return Root(request.getfixturevalue("s3_root"), request.getfixturevalue("s3_options"))
    return Root(memory_root, exclusive=request.param == "exclusive")


class _Killed(Exception):
    """Where a kill ends a writer: nothing of its clean-up runs after it."""


class _KilledInWriteData(SafeStorageWriter):
    """Writes this rank's shards and rank manifest, then dies with the lease held."""

    def _write_rank(self, *args: Any, **kwargs: Any) -> Any:
        super()._write_rank(*args, **kwargs)
        raise _Killed("killed inside write_data")

    def _abandon(self, *args: Any) -> None:
        return None  # a killed process removes nothing


def _crash(root: Root, name: str, *, attempt: int | None, **kwargs: Any) -> None:
    """A save of ``name`` by ``attempt`` killed inside ``write_data``: the lease, three shard
    files and the rank manifest stay behind."""
    writer = root.writer(_KilledInWriteData, attempt=attempt, options=THREE_FILES, **kwargs)
    with pytest.raises(dcp_safe.CommitError):
        dcp_safe.save(make_state(1), checkpoint_id=name, storage_writer=writer)
    left = set(root.backend().walk_files(name))
    assert {"__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "_ranks/rank_00000.json"} <= left
    assert any(layout.is_lease_file(rel) for rel in left)


def _save(root: Root, name: str, state: dict[str, Any], **kwargs: Any) -> None:
    dcp_safe.save(state, checkpoint_id=name, storage_writer=root.writer(**kwargs))


def _load(root: Root, name: str, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    reader = SafeStorageReader(root.url, storage_options=root.options)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    return target


def _assert_whole_and_only_its_own(root: Root, name: str, state: dict[str, Any]) -> None:
    """Committed, verified, loads exactly ``state``, and holds nothing but its own files."""
    dcp_safe.verify_checkpoint(root.url, name, storage_options=root.options)
    assert_state_equal(_load(root, name, state), state)
    backend = root.backend()
    manifest = open_committed(backend, name).manifest
    own = {record.path for record in manifest.files} | {layout.MANIFEST, layout.COMMITTED_MARKER}
    assert sorted(backend.walk_files(name)) == sorted(own)


# --------------------------------------------------------------------- the restart saves


def test_a_restarted_attempt_takes_over_the_lease_a_killed_attempt_left_and_commits(
    root: Root,
) -> None:
    _crash(root, "step_1", attempt=0)

    state = make_state(2)
    _save(root, "step_1", state, attempt=1)  # one shard file: the killed save had three

    _assert_whole_and_only_its_own(root, "step_1", state)
    assert open_committed(root.backend(), "step_1").manifest.attempt == 1


@pytest.mark.s3
@pytest.mark.multiproc
def test_a_process_killed_with_sigkill_inside_write_data_does_not_block_the_restart(
    s3: Any, s3_bucket: str, s3_root: str, s3_options: dict[str, Any]
) -> None:
    """A real SIGKILL while a shard's multipart upload is open: the restart commits, and the
    killed attempt's finished shard and open upload are gone."""
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, s3_root, json.dumps(s3_options)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    backend = open_backend(s3_root, s3_options)
    assert backend.exists(f"step_1/{layout.WRITING_LEASE}")
    assert backend.exists("step_1/__0_1.distcp")  # the small shard, finished before the kill
    assert [u["Key"].rpartition("/")[2] for u in s3.open_uploads(s3_bucket)] == ["__0_0.distcp"]

    state = _big_state(2)
    root = Root(s3_root, s3_options)
    _save(root, "step_1", state, attempt=1)

    _assert_whole_and_only_its_own(root, "step_1", state)
    assert s3.open_uploads(s3_bucket) == []


def _big_state(seed: int) -> dict[str, Any]:
    """Tensors over two 5 MiB multipart blocks, small ones and an object (``blank_like``'s)."""
    state = make_state(seed)
    state["big"] = torch.randn(3 * 2**20, generator=torch.Generator().manual_seed(seed))
    return state


# Saves step_1 as attempt 0 with two shard files and kills itself with SIGKILL once the big
# item is in its (open) multipart upload and the small shard file exists.
_KILLED_CHILD = """
import json, os, signal, sys, time
import torch
import dcp_safe
from dcp_safe import SafeStorageWriter

root, options = sys.argv[1], json.loads(sys.argv[2])
gen = torch.Generator().manual_seed(1)
state = {"big": torch.randn(3 * 2**20, generator=gen), "small": torch.randn(8, generator=gen)}

class KilledMidUpload(SafeStorageWriter):
    def _write_item(self, sink, file_name, item, planner):
        record = super()._write_item(sink, file_name, item, planner)
        if item.index.fqn == "big":
            deadline = time.monotonic() + 60
            while not self.backend.exists("step_1/__0_1.distcp") and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return record

two = dcp_safe.WriterOptions(thread_count=2)
writer = KilledMidUpload(root, storage_options=options, attempt=0, options=two)
dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)
"""


# --------------------------------------------------------------------- a rank failed, peers wrote


class _FailsInWriteData(SafeStorageWriter):
    """This rank's storage fails in ``write_data`` (its clean-up runs, as in a real failure)."""

    def _write_rank(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, "injected: this rank's storage failed")


def _save_with_rank_0_failing(rank: int, world_size: int, url: str, options: dict[str, Any]) -> str:
    kind = _FailsInWriteData if rank == 0 else SafeStorageWriter
    writer = kind(url, storage_options=options, attempt=0)
    state = {f"rank{rank}": torch.full((64,), float(rank))}
    try:
        dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer)
    except dcp_safe.DcpSafeError as exc:
        return type(exc).__name__
    return "saved"


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.parametrize("attempt", [1, None], ids=["newer_attempt", "unfenced"])
def test_a_save_after_one_rank_failed_commits_none_of_its_peers_objects(
    s3_root: str, s3_options: dict[str, Any], attempt: int | None
) -> None:
    """Rank 0 fails in ``write_data``; rank 1's shard and rank manifest stay under the name.
    The lease is left marked abandoned, so the restart on one rank takes it over and clears
    them (a released lease let it commit them inside its checkpoint)."""
    outcomes = run_ranks(_save_with_rank_0_failing, 2, args=(s3_root, s3_options))
    assert outcomes == ["CommitError", "CommitError"]
    backend = open_backend(s3_root, s3_options)
    assert {"__1_0.distcp", "_ranks/rank_00001.json"} <= set(backend.walk_files("step_1"))
    holder = read_holder(backend, f"step_1/{layout.WRITING_LEASE}")
    assert holder is not None and holder.abandoned

    state = make_state(2)
    _save(Root(s3_root, s3_options), "step_1", state, attempt=attempt)

    _assert_whole_and_only_its_own(Root(s3_root, s3_options), "step_1", state)


def test_an_abandoned_lease_is_taken_over_by_any_save_and_its_leftovers_cleared(
    leased: Root,
) -> None:
    backend = leased.backend()
    acquire_lease(backend, "step_1", "failed", _claimant(4))
    backend.write_bytes("step_1/__1_0.distcp", b"a peer's shard")
    with pytest.raises(CheckpointExistsError):  # held, and not abandoned: refused
        acquire_lease(backend, "step_1", "mine", Claimant())

    abandon_lease(backend, "step_1", "failed", _claimant(4))
    acquire_lease(backend, "step_1", "mine", Claimant())  # unfenced, and of no attempt

    check_lease(backend, "step_1", "mine")
    assert list(backend.walk_files("step_1")) == [layout.lease_file_name(_kind(leased, "mine"))]


# --------------------------------------------------------------------- the old writer is fenced


class _Paused(SafeStorageWriter):
    """Pauses in ``write_data`` (before writing, or after) until ``release`` is set."""

    def __init__(self, *args: Any, pause_before: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pause_before = pause_before
        self.paused = threading.Event()
        self.release = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.pause_before:
            self._pause()
        future = super().write_data(plan, planner)
        if not self.pause_before:
            self._pause()
        return future

    def _pause(self) -> None:
        self.paused.set()
        assert self.release.wait(_TIMEOUT_S), "the test never released the paused writer"


class _Running:
    """A save of ``step_1`` on a thread, paused in ``write_data``."""

    def __init__(self, writer: _Paused, state: dict[str, Any]) -> None:
        self.writer = writer
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(state,), name="old-attempt")
        self.thread.start()
        assert writer.paused.wait(_TIMEOUT_S), "the old attempt never reached write_data"

    def _run(self, state: dict[str, Any]) -> None:
        try:
            dcp_safe.save(state, checkpoint_id="step_1", storage_writer=self.writer)
        except BaseException as exc:
            self.errors.append(exc)

    def resume(self) -> list[BaseException]:
        self.writer.release.set()
        self.thread.join(_TIMEOUT_S)
        assert not self.thread.is_alive(), "the old attempt did not finish"
        return self.errors


@pytest.fixture
def running() -> Iterator[Callable[[_Paused, dict[str, Any]], _Running]]:
    started: list[_Running] = []

    def start(writer: _Paused, state: dict[str, Any]) -> _Running:
        started.append(_Running(writer, state))
        return started[-1]

    yield start
    for run in started:
        run.resume()


def test_an_old_attempt_that_resumes_after_the_takeover_cannot_publish(
    root: Root, running: Callable[[_Paused, dict[str, Any]], _Running]
) -> None:
    old = running(root.writer(_Paused, attempt=0, options=THREE_FILES), make_state(1))

    state = make_state(2)
    _save(root, "step_1", state, attempt=1)
    [error] = old.resume()

    assert isinstance(error, StaleWriterError)
    _assert_whole_and_only_its_own(root, "step_1", state)


def test_a_rank_of_the_old_attempt_that_resumes_writes_nothing_into_the_new_checkpoint(
    root: Root, running: Callable[[_Paused, dict[str, Any]], _Running]
) -> None:
    """Paused before it wrote a byte (the lease taken at plan time): once resumed it finds the
    lease gone to the newer attempt, writes nothing, and removes nothing of the committed one."""
    old = running(root.writer(_Paused, attempt=0, pause_before=True), make_state(1))

    state = make_state(2)
    _save(root, "step_1", state, attempt=1)
    [error] = old.resume()

    assert isinstance(error, dcp_safe.DcpSafeError)
    _assert_whole_and_only_its_own(root, "step_1", state)


# --------------------------------------------------------------------- only one wins


def test_racing_takeovers_of_one_exclusive_lease_have_exactly_one_winner(memory_root: str) -> None:
    """Two savers of the new attempt both judge the old lease before either takes it."""
    acquire_lease(open_backend(memory_root), "step_1", "old", _claimant(0))
    both_judged = threading.Barrier(2, timeout=_TIMEOUT_S)
    outcomes: dict[str, BaseException | None] = {}

    def race(save_id: str) -> None:
        backend = open_backend(memory_root)
        write = backend.write_bytes
        met: list[bool] = []

        def meet_first(rel: str, data: bytes, *, exclusive: bool = False) -> None:
            if layout.TAKEOVER_PREFIX in rel and not met:
                met.append(True)
                both_judged.wait()  # once: a second try at the record follows the winner's
            write(rel, data, exclusive=exclusive)

        backend.write_bytes = meet_first  # type: ignore[method-assign]
        try:
            acquire_lease(backend, "step_1", save_id, _claimant(1))
            outcomes[save_id] = None
        except BaseException as exc:
            outcomes[save_id] = exc

    threads = [threading.Thread(target=race, args=(s,)) for s in ("new-a", "new-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_TIMEOUT_S)

    [winner] = [save_id for save_id, error in outcomes.items() if error is None]
    [loser] = [error for error in outcomes.values() if error is not None]
    assert isinstance(loser, CheckpointExistsError)
    backend = open_backend(memory_root)
    check_lease(backend, "step_1", winner)
    assert backend.list_dir("step_1") == [layout.WRITING_LEASE]  # no record left behind


def test_racing_restarted_saves_commit_once(root: Root) -> None:
    _crash(root, "step_1", attempt=0)
    errors: list[BaseException] = []
    states = {seed: make_state(seed) for seed in (2, 3)}

    def save(seed: int) -> None:
        try:
            _save(root, "step_1", states[seed], attempt=1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(seed,)) for seed in states]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_TIMEOUT_S)

    if root.exclusive:  # with one lease per save, both may withdraw: at most one wins
        assert len(errors) == 1
    assert all(isinstance(error, CheckpointExistsError) for error in errors), errors
    if len(errors) == 2:
        return
    winner = _load(root, "step_1", make_state(0))["extra"]["epoch"]  # the seed of its state
    _assert_whole_and_only_its_own(root, "step_1", states[winner])


def test_a_takeover_that_died_half_way_does_not_block_the_next_attempt(memory_root: str) -> None:
    backend = open_backend(memory_root)
    acquire_lease(backend, "step_1", "old", _claimant(0))
    # Attempt 1 created its record, then was killed before it rewrote the lease.
    backend.write_bytes(
        f"step_1/{layout.takeover_record_name('old')}", _claimant(1).body("mid"), exclusive=True
    )
    with pytest.raises(CheckpointExistsError, match="mid"):
        acquire_lease(backend, "step_1", "same-as-the-dead", _claimant(1))

    acquire_lease(backend, "step_1", "newer", _claimant(2))

    check_lease(backend, "step_1", "newer")
    assert backend.list_dir("step_1") == [layout.WRITING_LEASE]


# --------------------------------------------------------------------- what is never taken


def _claimant(number: int, run_id: str = "default", **kwargs: Any) -> Claimant:
    return Claimant(attempt=Attempt(number=number, run_id=run_id), **kwargs)


@pytest.fixture(params=["exclusive", "per_save"])
def leased(request: pytest.FixtureRequest, memory_root: str) -> Root:
    return Root(memory_root, exclusive=request.param == "exclusive")


@pytest.mark.parametrize("holder", [1, 2], ids=["same_attempt", "newer_attempt"])
def test_a_lease_of_the_same_or_a_newer_attempt_is_refused(leased: Root, holder: int) -> None:
    backend = leased.backend()
    acquire_lease(backend, "step_1", "holder", _claimant(holder))
    with pytest.raises(CheckpointExistsError, match="holder"):
        acquire_lease(backend, "step_1", "mine", _claimant(1, stale_after_s=0))
    assert backend.list_dir("step_1") == [layout.lease_file_name(_kind(leased, "holder"))]


def _kind(root: Root, save_id: str) -> str | None:
    return None if root.exclusive else save_id


@pytest.mark.parametrize(
    "lease",
    [
        {"save_id": "legacy", "acquired_at": 1.0},  # an older dcp_safe's lease: no attempt
        {"save_id": "other-run", "acquired_at": 1.0, "attempt": 0, "run_id": "job-a"},
    ],
    ids=["legacy", "another_run"],
)
def test_a_lease_naming_no_attempt_of_this_run_is_taken_only_once_idle(
    leased: Root, lease: dict[str, Any]
) -> None:
    backend = leased.backend()
    path = f"step_1/{layout.lease_file_name(_kind(leased, str(lease['save_id'])))}"
    backend.write_bytes(path, json.dumps(lease).encode())
    for never in (None, 3600.0):  # not taken over: never by idleness, or not idle long enough
        with pytest.raises(CheckpointExistsError):
            acquire_lease(
                backend, "step_1", "mine", _claimant(5, run_id="job-b", stale_after_s=never)
            )
    with pytest.raises(CheckpointExistsError):  # an unfenced save never takes over
        acquire_lease(backend, "step_1", "mine", Claimant(stale_after_s=0))
    assert backend.exists(path)

    acquire_lease(backend, "step_1", "mine", _claimant(5, run_id="job-b", stale_after_s=0))

    check_lease(backend, "step_1", "mine")
    assert backend.list_dir("step_1") == [layout.lease_file_name(_kind(leased, "mine"))]


def test_a_committed_name_is_never_taken_over(root: Root) -> None:
    state = make_state(1)
    _save(root, "step_1", state, attempt=0)
    backend = root.backend()
    # A lease of attempt 0 beside the marker (its removal failed after the commit).
    stale = f"step_1/{layout.lease_file_name(_kind(root, 'old'))}"
    backend.write_bytes(stale, _claimant(0).body("old"))

    with pytest.raises(CheckpointExistsError):
        _save(root, "step_1", make_state(2), attempt=1)
    with pytest.raises(CheckpointExistsError):
        acquire_lease(backend, "step_1", "mine", _claimant(1, stale_after_s=0))

    backend.remove_file(stale)
    _assert_whole_and_only_its_own(root, "step_1", state)


def test_a_lease_records_its_holders_attempt_and_an_old_lease_still_reads(
    memory_root: str,
) -> None:
    backend = open_backend(memory_root)
    acquire_lease(backend, "step_1", "mine", _claimant(3, run_id="job-a"))
    holder = read_holder(backend, f"step_1/{layout.WRITING_LEASE}")
    assert holder is not None
    assert (holder.save_id, holder.attempt, holder.run_id) == ("mine", 3, "job-a")

    backend.write_bytes("step_2/_WRITING", b'{"save_id": "old", "acquired_at": 5.0}')
    old = read_holder(backend, f"step_2/{layout.WRITING_LEASE}")
    assert old is not None
    assert (old.save_id, old.attempt, old.run_id, old.acquired_at) == ("old", None, None, 5.0)
    assert read_holder(backend, "step_3/_WRITING") is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "60", True])
def test_a_stale_lease_bound_that_is_not_a_non_negative_number_is_a_config_error(
    memory_root: str, bad: Any
) -> None:
    with pytest.raises(dcp_safe.ConfigError, match="stale_after_s"):
        SafeStorageWriter(memory_root, attempt=1, stale_lease_s=bad)


# --------------------------------------------------------- a relaunch: a new run id, same root


def _next_storage_second() -> None:
    """Wait until the clock has moved to its next whole second: S3 keeps modification times in
    whole seconds, and the relaunch rule compares two of them strictly."""
    time.sleep(1.05 - time.time() % 1)


def _history(backend: Backend) -> list[dict[str, Any]]:
    return [e for e in History(backend).read() if e["event"] == "lease_taken_over"]


def test_a_relaunch_takes_over_a_lease_left_before_it_started_and_says_so_in_history(
    root: Root,
) -> None:
    """A new run id (torchrun --standalone run again): the dead run's lease names no attempt of
    this run and is not idle for an hour, but nothing under the name changed since this job's
    start (its attempt record), so the relaunch takes it over and records it."""
    backend = root.backend()
    acquire_lease(backend, "step_2", "dead-save", _claimant(0, run_id="job-a"))
    backend.write_bytes("step_2/__0_0.distcp", b"what the dead run wrote")
    _next_storage_second()

    relaunch = _claimant(0, run_id="job-b")
    assert relaunch.attempt is not None
    register_attempt(backend, relaunch.attempt)  # this job's start, as its first claim records it
    acquire_lease(backend, "step_2", "new-save", relaunch)

    check_lease(backend, "step_2", "new-save")
    assert backend.list_dir("step_2") == [layout.lease_file_name(_kind(root, "new-save"))]
    (event,) = _history(backend)
    assert event["name"] == "step_2"
    assert "save dead-save of run job-a, attempt 0" in event["reason"]
    assert "nothing under the name changed since this job started" in event["reason"]


def test_a_relaunch_never_takes_the_lease_of_a_writer_still_writing(root: Root) -> None:
    """The lease predates this job, but its writer uploaded after this job started: live."""
    backend = root.backend()
    acquire_lease(backend, "step_2", "live-save", _claimant(0, run_id="job-a"))
    _next_storage_second()
    relaunch = _claimant(0, run_id="job-b")
    assert relaunch.attempt is not None
    register_attempt(backend, relaunch.attempt)
    _next_storage_second()
    backend.write_bytes("step_2/__0_0.distcp", b"a shard of the live writer")  # its heartbeat

    with pytest.raises(CheckpointExistsError, match="live-save"):
        acquire_lease(backend, "step_2", "new-save", relaunch)

    check_lease(backend, "step_2", "live-save")
    assert backend.exists("step_2/__0_0.distcp") and _history(backend) == []


# The first run of the job: a manager (run id job-a) commits step 1, then SIGKILLs itself while
# writing step 2, its lease held on S3.
_KILLED_MANAGER = """
import json, os, signal, sys
import torch
from dcp_safe import CheckpointManager, Runtime, Topology
from dcp_safe.adapters.writer import SafeStorageWriter

root, options = sys.argv[1], json.loads(sys.argv[2])
write_item = SafeStorageWriter._write_item

def dies_in_step_2(self, sink, file_name, item, planner):
    if self.backend.exists("step_000000002/_WRITING") or self.backend.list_dir("step_000000002"):
        os.kill(os.getpid(), signal.SIGKILL)
    return write_item(self, sink, file_name, item, planner)

SafeStorageWriter._write_item = dies_in_step_2
topology = Topology.of(root, storage_options=options)
manager = CheckpointManager(topology, runtime=Runtime(executor="thread"))
manager.save(1, {"w": torch.ones(8)}).committed.result(120)
manager.save(2, {"w": torch.full((8,), 2.0)}).committed.result(120)
"""


@pytest.mark.s3
@pytest.mark.multiproc
def test_a_relaunched_job_with_a_new_run_id_commits_the_step_its_killed_run_held(
    s3_root: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43 #13: ``torchrun --standalone`` run again gets a new run id; the killed run's
    lease on step 2 held up the relaunch's save of step 2 for an hour (CheckpointExistsError
    at close). Now it is taken over, and the root's history says whose it was. The relaunch is
    built as a user builds it (its save and takeover run in the checkpoint worker)."""
    env = dict(os.environ, **{RUN_ID_ENV: "job-a", ATTEMPT_ENV: "0"})
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MANAGER, s3_root, json.dumps(s3_options)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert killed.returncode == -9, killed.stderr
    backend = open_backend(s3_root, s3_options)
    assert any(layout.is_lease_file(e) for e in backend.list_dir("step_000000002"))
    _next_storage_second()

    monkeypatch.setenv(RUN_ID_ENV, "job-b")
    monkeypatch.setenv(ATTEMPT_ENV, "0")
    with CheckpointManager(Topology.of(s3_root, storage_options=s3_options)) as manager:
        target = {"w": torch.zeros(8)}
        manager.restore(target)
        assert torch.equal(target["w"], torch.ones(8))
        manager.save(2, {"w": torch.full((8,), 3.0)}).committed.result(_TIMEOUT_S)
        events = [e for e in manager.history() if e["event"] == "lease_taken_over"]

    (event,) = events
    assert event["name"] == "step_000000002" and "of run job-a, attempt 0" in event["reason"]
    assert open_committed(backend, "step_000000002").manifest.attempt == 0
    target = {"w": torch.zeros(8)}
    dcp_safe.load(
        target,
        checkpoint_id="step_000000002",
        storage_reader=SafeStorageReader(s3_root, storage_options=s3_options),
    )
    assert torch.equal(target["w"], torch.full((8,), 3.0))
