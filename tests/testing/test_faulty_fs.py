"""FaultyFileSystem: each kind of fault lands where the plan says, deterministically, and
dcp_safe's backends run on top of it with the capability flags of the storage underneath."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from _crash import is_bit_exact, load_values, make_values
from fsspec.implementations.local import LocalFileSystem

import dcp_safe
from dcp_safe import ConfigError, SafeStorageWriter, StorageError
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.retry import RetryingBackend, RetryPolicy
from dcp_safe.backends.roots import open_backend
from dcp_safe.testing.fault_plan import MAX_HANG_S
from dcp_safe.testing.faulty_fs import (
    FaultInjector,
    FaultPlan,
    FaultyFileSystem,
    InjectedFault,
)


def _faulty(plan: FaultPlan) -> FaultyFileSystem:
    return FaultyFileSystem(LocalFileSystem(), plan=plan)


@pytest.mark.parametrize(
    "bad",
    [
        {"fail_at": 0},
        {"fail_at": 1.5},
        {"persistent": True},
        {"fail_probability": 1.5},
        {"flip_probability": -0.1},
        {"delay_s": -1.0},
        {"delay_s": float("nan")},
        {"hang_s": MAX_HANG_S + 1},
        {"ops": ("write", "teleport")},
        {"error": "ebadluck"},
        {"seed": "seven"},
    ],
)
def test_nonsense_plans_are_refused_with_config_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        FaultPlan(**bad)


def test_plan_is_frozen_and_normalises_a_single_kind() -> None:
    plan = FaultPlan(ops="write", error="enospc")  # type: ignore[arg-type]
    assert plan.ops == ("write",)
    assert plan.error.value == "enospc"
    with pytest.raises(AttributeError):
        plan.fail_at = 3  # type: ignore[misc]


def test_nth_operation_over_all_kinds_fails_once_with_eio(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=3))
    fs.pipe_file(str(tmp_path / "a"), b"1")  # op 1
    assert fs.exists(str(tmp_path / "a"))  # op 2
    with pytest.raises(OSError) as info:
        fs.cat_file(str(tmp_path / "a"))  # op 3
    assert info.value.errno == errno.EIO and isinstance(info.value, InjectedFault)
    assert fs.cat_file(str(tmp_path / "a")) == b"1"  # one-off: op 4 succeeds
    assert fs.faults.calls == 4
    assert dict(fs.counts) == {"pipe": 1, "info": 1, "read": 2}
    assert [(r.number, r.kind) for r in fs.faults.failures] == [(3, "read")]


def test_persistent_failure_fails_every_selected_operation_from_n_on(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=2, persistent=True, ops=("pipe",), error="enospc"))
    fs.pipe_file(str(tmp_path / "a"), b"1")
    for name in ("b", "c", "d"):
        with pytest.raises(OSError) as info:
            fs.pipe_file(
                str(tmp_path / name),
                b"2",
            )
        assert info.value.errno == errno.ENOSPC
    assert fs.exists(str(tmp_path / "a"))  # other kinds pass: "info" is not selected
    assert fs.faults.injected["fail"] == 3


def test_per_kind_counting_fails_the_second_write_and_leaves_a_torn_file(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=2, ops=("write",)))
    path = str(tmp_path / "torn")
    f = fs.open(path, "wb")
    f.write(b"first-")
    with pytest.raises(OSError):
        f.write(b"0123456789")
    f.close()
    assert Path(path).read_bytes() == b"first-01234"  # half of the failing write landed


def test_torn_pipe_stores_half_then_raises(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=1))
    with pytest.raises(OSError):
        fs.pipe_file(str(tmp_path / "x"), b"abcdefgh")
    assert (tmp_path / "x").read_bytes() == b"abcd"


def test_untorn_failure_writes_nothing(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=1, torn=False))
    with pytest.raises(OSError):
        fs.pipe_file(str(tmp_path / "x"), b"abcdefgh")
    assert not (tmp_path / "x").exists()


def test_flips_change_exactly_one_byte_of_written_and_read_data(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4
    fs = _faulty(FaultPlan(flip_probability=1.0, ops=("pipe",)))
    fs.pipe_file(str(tmp_path / "w"), data)
    written = (tmp_path / "w").read_bytes()
    assert len(written) == len(data)
    assert sum(a != b for a, b in zip(written, data, strict=True)) == 1
    (tmp_path / "r").write_bytes(data)
    reader = _faulty(FaultPlan(flip_probability=1.0, ops=("read",)))
    with reader.open(str(tmp_path / "r"), "rb") as f:
        got = f.read()
    assert sum(a != b for a, b in zip(got, data, strict=True)) == 1
    assert reader.faults.injected["flip"] == 1


def test_probabilistic_faults_repeat_exactly_for_a_seed(tmp_path: Path) -> None:
    def run(seed: int) -> list[int]:
        fs = _faulty(FaultPlan(seed=seed, fail_probability=0.3, ops=("info",)))
        failed = []
        for i in range(60):
            try:
                fs.exists(str(tmp_path))
            except OSError:
                failed.append(i)
        return failed

    first = run(11)
    assert first == run(11)
    assert first != run(12)
    assert 0 < len(first) < 60


def test_reset_zeroes_counters_and_restarts_the_random_sequence(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=2))
    fs.exists(str(tmp_path))
    with pytest.raises(OSError):
        fs.exists(str(tmp_path))
    fs.reset()
    assert fs.faults.calls == 0 and not fs.faults.failures
    fs.exists(str(tmp_path))
    with pytest.raises(OSError):
        fs.exists(str(tmp_path))  # the second operation after the reset fails again
    fs.reset(FaultPlan())
    fs.exists(str(tmp_path))
    fs.exists(str(tmp_path))


def test_hang_is_bounded_then_raises_a_transient_timeout(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=1, hang_s=0.05, error="timeout"))
    with pytest.raises(TimeoutError):
        fs.ls(str(tmp_path))
    assert fs.faults.injected["hang"] == 1


def test_delay_is_applied_to_selected_operations_only(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(delay_s=0.001, ops=("mkdir",)))
    fs.makedirs(str(tmp_path / "d"), exist_ok=True)
    fs.exists(str(tmp_path / "d"))
    assert fs.faults.injected["delay"] == 1
    assert fs.faults.selected == 1 and fs.faults.calls == 2


def test_release_ends_a_delay_in_progress_and_stops_injecting(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(delay_s=600.0, ops=("mkdir",)))
    stuck = threading.Thread(target=fs.makedirs, args=(str(tmp_path / "d"),), daemon=True)
    stuck.start()
    while fs.faults.injected["delay"] == 0:  # the thread is inside its delay
        time.sleep(0.01)
    fs.faults.release()
    stuck.join(timeout=60)
    assert not stuck.is_alive()
    fs.makedirs(str(tmp_path / "e"), exist_ok=True)  # no delay any more
    assert fs.faults.injected["delay"] == 1 and fs.faults.calls == 2


def test_pause_stops_injecting_but_keeps_counting(tmp_path: Path) -> None:
    fs = _faulty(FaultPlan(fail_at=1, persistent=True))
    fs.faults.pause()
    assert fs.exists(str(tmp_path))
    fs.faults.resume()
    with pytest.raises(OSError):
        fs.exists(str(tmp_path))
    assert fs.faults.calls == 2


def test_opened_by_url_with_a_shared_injector(tmp_path: Path) -> None:
    faults = FaultInjector(FaultPlan())
    with fsspec.open(f"faulty://{tmp_path}/x", "wb", target_protocol="file", faults=faults) as f:
        f.write(b"hello")
    fs, path = fsspec.core.url_to_fs(f"faulty://{tmp_path}/x", faults=faults)
    assert isinstance(fs, FaultyFileSystem) and path == f"{tmp_path}/x"
    assert fs.cat_file(path) == b"hello"
    assert faults.counts["open"] == 1 and faults.counts["read"] == 1


# --------------------------------------------------------------------------- backends


def test_faulty_local_root_is_fsspec_without_atomic_rename(tmp_path: Path) -> None:
    faults = FaultInjector()
    backend = open_backend(f"faulty://{tmp_path}", {"target_protocol": "file", "faults": faults})
    assert isinstance(backend, FsspecBackend)
    assert not backend.supports_atomic_rename and not backend.supports_exclusive_create
    assert not backend.object_store


def test_save_verify_and_load_through_a_faulty_local_root(tmp_path: Path) -> None:
    faults = FaultInjector()
    options = {"target_protocol": "file", "faults": faults}
    root = f"faulty://{tmp_path}"
    values = make_values(5)
    writer = SafeStorageWriter(root, storage_options=options)
    dcp_safe.save(values, checkpoint_id="step_5", storage_writer=writer, no_dist=True)
    dcp_safe.verify_checkpoint(root, "step_5", storage_options=options)
    assert is_bit_exact(load_values(tmp_path, "step_5", values), values)
    # Small files too go through a hidden sibling moved into place: a write never tears them.
    assert faults.counts["write"] > 0 and faults.counts["move"] > 0 and not faults.counts["pipe"]


def test_instance_passed_through_storage_options_is_the_one_wrapped(tmp_path: Path) -> None:
    inner = LocalFileSystem()
    faults = FaultInjector(FaultPlan(fail_at=1, persistent=True, ops=("move",)))
    writer = SafeStorageWriter(
        f"faulty://{tmp_path}", storage_options={"fs": inner, "faults": faults}
    )
    backend = writer.backend
    assert isinstance(backend, FsspecBackend) and isinstance(backend.fs, FaultyFileSystem)
    assert backend.fs.fs is inner
    with pytest.raises(StorageError) as info:
        dcp_safe.save(make_values(1), checkpoint_id="step_1", storage_writer=writer, no_dist=True)
    assert "injected fault" in str(info.value)
    assert not dcp_safe.list_checkpoints(tmp_path)


@pytest.mark.s3
def test_faulty_s3_root_keeps_retries_conditional_puts_and_multipart_path(
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    faults = FaultInjector()
    options = {"target_protocol": "s3", "target_options": s3_options, "faults": faults}
    root = "faulty://" + s3_root.removeprefix("s3://")
    backend = open_backend(root, options)
    assert isinstance(backend, RetryingBackend)
    assert backend.supports_exclusive_create and not backend.supports_atomic_rename
    backend.write_bytes("lease", b"mine", exclusive=True)
    with pytest.raises(FileExistsError):
        backend.write_bytes("lease", b"theirs", exclusive=True)
    with backend.open_write("stream") as f:
        f.write(b"x" * 1000)
    assert backend.read_bytes("stream") == b"x" * 1000
    # The stream went through s3fs's call_s3 (the pipelined path), still through the injector.
    assert faults.counts["pipe"] >= 3


@pytest.mark.s3
def test_transient_fault_on_s3_is_retried_and_the_save_commits(
    s3_root: str,
    s3_options: dict[str, Any],
) -> None:
    faults = FaultInjector(FaultPlan(fail_at=2, error="timeout", ops=("info",)))
    options = {"target_protocol": "s3", "target_options": s3_options, "faults": faults}
    root = "faulty://" + s3_root.removeprefix("s3://")
    values = make_values(3)
    writer = SafeStorageWriter(
        root, storage_options=options, retry=RetryPolicy(base_delay_s=0.01, max_delay_s=0.02)
    )
    dcp_safe.save(values, checkpoint_id="step_3", storage_writer=writer, no_dist=True)
    assert faults.injected["fail"] == 1
    dcp_safe.verify_checkpoint(s3_root, "step_3", storage_options=s3_options)
    assert is_bit_exact(_load_s3(s3_root, s3_options, values), values)


def _load_s3(root: str, options: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    from _crash import blank_like

    target = blank_like(like)
    reader = dcp_safe.SafeStorageReader(root, storage_options=options)
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=reader, no_dist=True)
    return target
