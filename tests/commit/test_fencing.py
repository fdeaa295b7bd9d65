"""Fencing: a writer of an older job attempt never publishes once a newer attempt has saved.

Real DCP saves (single process, ``no_dist``) on a local root and on an S3 root (moto server).
The "running" old writer is a real save paused inside ``write_data`` on a thread, after its
bytes reached storage, while the newer attempt saves and commits on the test's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import ConfigError, SafeStorageReader, SafeStorageWriter, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.commit.fencing import ATTEMPT_ENV, RUN_ID_ENV, attempt_from_env
from dcp_safe.errors import InvalidCheckpointNameError, StaleWriterError

Root = tuple[str, dict[str, Any] | None]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> Root:
    if request.param == "local":
        return str(tmp_path / "run"), None
    return request.getfixturevalue("s3_root"), request.getfixturevalue("s3_options")


@pytest.fixture(autouse=True)
def _no_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


class _PausedWriter(SafeStorageWriter):
    """Writes its shards and rank manifest, then waits for ``release`` before DCP goes on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written = threading.Event()
        self.release = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written.set()
        assert self.release.wait(60), "the test never released the paused writer"
        return future


def _save(root: Root, name: str, state: dict[str, Any], **writer_kwargs: Any) -> None:
    url, options = root
    writer = SafeStorageWriter(url, storage_options=options, **writer_kwargs)
    dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)


def _load(root: Root, name: str, like: dict[str, Any]) -> dict[str, Any]:
    url, options = root
    target = blank_like(like)
    reader = SafeStorageReader(url, storage_options=options)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    return target


def _listed(root: Root) -> list[str]:
    url, options = root
    return [info.name for info in dcp_safe.list_checkpoints(url, storage_options=options)]


def _entries(root: Root) -> list[str]:
    url, options = root
    return sorted(open_backend(url, options).list_dir(""))


class _OldAttempt:
    """Attempt 1 saving ``step_100`` on a thread, paused after its bytes reached storage."""

    def __init__(self, root: Root) -> None:
        url, options = root
        self.writer = _PausedWriter(url, storage_options=options, attempt=1)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="attempt-1-writer")
        self.thread.start()
        assert self.writer.written.wait(60), "attempt 1 never reached write_data"

    def _run(self) -> None:
        try:
            dcp_safe.save(make_state(1), checkpoint_id="step_100", storage_writer=self.writer)
        except BaseException as exc:
            self.errors.append(exc)

    def finish(self) -> list[BaseException]:
        """Let it go on to its commit; return what it raised."""
        self.writer.release.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "attempt 1 did not finish"
        return self.errors


@pytest.fixture
def old_attempt(root: Root) -> Iterator[_OldAttempt]:
    running = _OldAttempt(root)
    yield running
    running.finish()


def test_an_old_attempt_still_writing_is_refused_at_commit_once_a_newer_attempt_committed(
    root: Root, old_attempt: _OldAttempt
) -> None:
    _save(root, "step_200", make_state(2), attempt=2)

    [error] = old_attempt.finish()
    assert isinstance(error, StaleWriterError)
    assert list(error.failures) == [0]
    assert "attempt 1 of run 'default' is stale: attempt 2 has started" in error.failures[0]
    assert _listed(root) == ["step_200"]
    # Nothing of attempt 1 is left either: no partial directory, no object under its name.
    assert _entries(root) == [layout.ATTEMPTS_DIR, "step_200"]
    url, options = root
    assert open_committed(open_backend(url, options), "step_200").manifest.attempt == 2
    assert_state_equal(_load(root, "latest", make_state(2)), make_state(2))


def test_an_old_attempt_started_after_a_newer_one_is_refused_before_writing(root: Root) -> None:
    _save(root, "step_200", make_state(2), attempt=2)
    before = _entries(root)

    with pytest.raises(StaleWriterError, match=r"attempt 1 .* stale: attempt 2 has started"):
        _save(root, "step_300", make_state(3), attempt=1)

    assert _entries(root) == before
    assert _listed(root) == ["step_200"]


def test_the_same_or_a_newer_attempt_keeps_saving_and_records_its_attempt(root: Root) -> None:
    _save(root, "step_1", make_state(1), attempt=3)
    _save(root, "step_2", make_state(2), attempt=3)
    _save(root, "step_3", make_state(3), attempt=4)

    url, options = root
    backend = open_backend(url, options)
    attempts = [open_committed(backend, n).manifest.attempt for n in ("step_1", "step_2", "step_3")]
    assert attempts == [3, 3, 4]
    assert _listed(root) == ["step_1", "step_2", "step_3"]


def test_the_attempt_defaults_to_torchelastics_restart_count_scoped_by_run_id(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUN_ID_ENV, "job-a")
    monkeypatch.setenv(ATTEMPT_ENV, "5")
    _save(root, "a_5", make_state(1))
    monkeypatch.setenv(ATTEMPT_ENV, "4")
    with pytest.raises(StaleWriterError):
        _save(root, "a_4", make_state(1))

    # A new job on the same root counts restarts from 0 again and is not fenced by job-a.
    monkeypatch.setenv(RUN_ID_ENV, "job-b")
    monkeypatch.setenv(ATTEMPT_ENV, "0")
    _save(root, "b_0", make_state(2))

    url, options = root
    backend = open_backend(url, options)
    assert open_committed(backend, "a_5").manifest.attempt == 5
    assert open_committed(backend, "b_0").manifest.attempt == 0
    assert _listed(root) == ["a_5", "b_0"]


def test_a_writer_without_an_attempt_is_not_fenced_and_records_none(root: Root) -> None:
    _save(root, "fenced", make_state(1), attempt=7)
    _save(root, "unfenced", make_state(2))

    url, options = root
    assert open_committed(open_backend(url, options), "unfenced").manifest.attempt is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_an_attempt_that_is_not_a_non_negative_int_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="attempt"):
        attempt_from_env(bad, environ={})


def test_a_restart_count_that_is_not_an_integer_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=ATTEMPT_ENV):
        attempt_from_env(environ={ATTEMPT_ENV: "three"})


def test_the_fencing_directory_cannot_be_used_as_a_checkpoint_name() -> None:
    with pytest.raises(InvalidCheckpointNameError):
        layout.validate_name(layout.ATTEMPTS_DIR)


# ---------------------------------------------------------------------- planted records


def test_a_planted_attempt_record_is_named_in_the_refusal_with_what_to_do(root: Root) -> None:
    """A file named as a newer attempt's record fences every save of the run; the refusal
    says which file it is and what to do, and a save under a new run id goes on."""
    url, options = root
    backend = open_backend(url, options)
    record = f"{layout.ATTEMPTS_DIR}/default/attempt_000000099"
    backend.makedirs(f"{layout.ATTEMPTS_DIR}/default")
    backend.write_bytes(record, b"99")

    with pytest.raises(StaleWriterError) as caught:
        _save(root, "step_1", make_state(1), attempt=1)
    message = str(caught.value)
    assert backend.full_path(record) in message
    assert "remove that file" in message and "TORCHELASTIC_RUN_ID" in message


def test_a_folder_named_as_an_attempt_record_is_no_record(tmp_path: Any) -> None:
    """An empty folder (or a link) under a record's name fences nothing: only files are
    records, as registering writes them."""
    root = tmp_path / "run"
    (root / layout.ATTEMPTS_DIR / "default" / "attempt_000000099").mkdir(parents=True)
    (root / layout.ATTEMPTS_DIR / "default" / "attempt_000000098").symlink_to(tmp_path)
    _save((str(root), None), "step_1", make_state(1), attempt=1)
    assert _listed((str(root), None)) == ["step_1"]
