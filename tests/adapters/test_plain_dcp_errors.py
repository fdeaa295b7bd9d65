"""What a user of plain ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` sees when storage is
misused: this project's error type and message on the first line, on 1 and on 2 ranks.

DCP wraps what a rank's writer raises in ``CheckpointException`` ("CheckpointException
ranks:dict_keys([0])" first); ``dcp_safe.translate_errors()`` is the documented way to get the
error itself, and it must agree with ``dcp_safe.save`` / ``load``, which translate the same way.
The five cases: a missing bucket, a full disk (writes fail with ENOSPC), a root that cannot be
created, a URL no file system serves, and S3 without credentials.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, translate_errors
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.testing.s3 import REGION, LocalS3

pytestmark = [pytest.mark.timeout(300)]

# Each case's error, as its first line reads: the type and a part of the message.
EXPECTED = {
    "missing_bucket/save": ("StorageError", "bucket does not exist"),
    "missing_bucket/load": (
        "CheckpointNotFoundError",
        "the root s3://no-such-bucket/run does not exist",
    ),
    "full_disk/save": ("StorageError", "[Errno 28]"),
    "unwritable_root/save": ("StorageError", "mkdir failed"),
    "bad_url/save": ("ConfigError", "no storage for nope://bucket/run"),
    "bad_url/load": ("ConfigError", "no storage for nope://bucket/run"),
    "no_credentials/save": ("StorageError", "NoCredentialsError"),
    "no_credentials/load": ("StorageError", "NoCredentialsError"),
}
LOADS = ("missing_bucket", "bad_url", "no_credentials")


def _state() -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32), "step": 3}


def _unwritable(tmp: Path) -> str:
    """A root that cannot be created: read-only for a user, under a regular file for root.
    Made once (by the test, before its ranks start), named again by each rank."""
    if os.geteuid() == 0:
        blocker = tmp / "file"
        if not blocker.exists():
            blocker.write_bytes(b"not a directory")
        return str(blocker / "root")
    locked = tmp / "locked"
    if not locked.exists():
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return str(locked / "root")


def _cases(tmp: str, endpoint: str, full_rank: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each case's root and storage options; only rank ``full_rank``'s disk is full."""
    full = FaultPlan(fail_at=1, persistent=True, ops=("write",), error="enospc")
    faults = FaultInjector(full if _rank() == full_rank else FaultPlan())
    keyed = {"key": "testing", "secret": "testing"}
    region = {"endpoint_url": endpoint, "client_kwargs": {"region_name": REGION}}
    return {
        "missing_bucket": ("s3://no-such-bucket/run", {**keyed, **region}),
        "full_disk": (f"faulty://{tmp}/full", {"target_protocol": "file", "faults": faults}),
        "unwritable_root": (_unwritable(Path(tmp)), {}),
        "bad_url": ("nope://bucket/run", {}),
        "no_credentials": ("s3://bucket/run", region),
    }


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _seen(call: Callable[[], Any]) -> tuple[str, str]:
    """The type and the first line of what ``call`` raises, as a traceback prints it."""
    try:
        call()
    except BaseException as exc:  # CheckpointException is a BaseException
        first = traceback.format_exception_only(type(exc), exc)[0]
        name, _, message = first.partition(": ")
        return name.rsplit(".", 1)[-1], message.strip()
    raise AssertionError("no error raised")


def _save(root: str, options: dict[str, Any], name: str) -> None:
    writer = SafeStorageWriter(root, storage_options=options)
    dcp.save(_state(), checkpoint_id=name, storage_writer=writer)


def _load(root: str, options: dict[str, Any]) -> None:
    reader = SafeStorageReader(root, storage_options=options)
    dcp.load(_state(), checkpoint_id="step_1", storage_reader=reader)


def _save_with_dcp_safe(root: str, options: dict[str, Any]) -> None:
    writer = SafeStorageWriter(root, storage_options=options)
    dcp_safe.save(_state(), checkpoint_id="step_2", storage_writer=writer)


def _translated(call: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    def run() -> Any:
        with translate_errors():
            return call(*args)

    return run


def _every_case(tmp: str, endpoint: str, full_rank: int) -> dict[str, tuple[str, str]]:
    """What plain DCP raises in each case through ``translate_errors``, keyed case/operation."""
    seen: dict[str, tuple[str, str]] = {}
    for case, (root, options) in _cases(tmp, endpoint, full_rank).items():
        seen[f"{case}/save"] = _seen(_translated(_save, root, options, "step_1"))
        if case in LOADS:
            seen[f"{case}/load"] = _seen(_translated(_load, root, options))
    return seen


def _on_rank(rank: int, world_size: int, tmp: str, endpoint: str) -> dict[str, tuple[str, str]]:
    return _every_case(tmp, endpoint, full_rank=1)


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nowhere for botocore to find credentials: no variables, no files, no metadata service."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _assert_expected(seen: dict[str, tuple[str, str]], where: str) -> None:
    assert sorted(seen) == sorted(EXPECTED), where
    for key, (kind, message) in seen.items():
        want_kind, want_text = EXPECTED[key]
        assert kind == want_kind and want_text in message, f"{where} {key}: {kind}: {message}"


@pytest.mark.usefixtures("no_aws_credentials")
def test_one_rank_sees_the_error_itself_first(tmp_path: Path, s3: LocalS3) -> None:
    _assert_expected(_every_case(str(tmp_path), s3.endpoint_url, full_rank=0), "1 rank")


@pytest.mark.multiproc
@pytest.mark.usefixtures("no_aws_credentials")
def test_two_ranks_see_the_error_itself_first(tmp_path: Path, s3: LocalS3) -> None:
    _unwritable(tmp_path)
    for rank, seen in enumerate(run_ranks(_on_rank, 2, args=(str(tmp_path), s3.endpoint_url))):
        _assert_expected(seen, f"rank {rank}")


def _unique(text: str) -> str:
    """``text`` without what differs from one save to the next: ids and operation counts."""
    return re.sub(r"[0-9a-f]{32}|#\d+", "<id>", text)


@pytest.mark.usefixtures("no_aws_credentials")
def test_translate_errors_agrees_with_dcp_safe_save_and_load(tmp_path: Path, s3: LocalS3) -> None:
    for case, (root, options) in _cases(str(tmp_path), s3.endpoint_url, 0).items():
        plain = _seen(_translated(_save, root, options, "step_2"))
        ours = _seen(partial(_save_with_dcp_safe, root, options))
        assert (plain[0], _unique(plain[1])) == (ours[0], _unique(ours[1])), case
    good = SafeStorageWriter(str(tmp_path / "good"))
    dcp_safe.save(_state(), checkpoint_id="step_1", storage_writer=good)
    wrong = {"w": torch.zeros(3), "step": 0}  # a shape the checkpoint does not hold
    reader = SafeStorageReader(str(tmp_path / "good"))
    plain = _seen(
        _translated(partial(dcp.load, wrong, checkpoint_id="step_1", storage_reader=reader))
    )
    ours = _seen(partial(dcp_safe.load, wrong, checkpoint_id="step_1", storage_reader=reader))
    assert plain[0] == ours[0] == "LoadError" and "Size mismatch" in plain[1]


def test_without_the_helper_dcp_shows_its_own_wrapper_first(tmp_path: Path) -> None:
    faults = FaultInjector(FaultPlan(fail_at=1, persistent=True, ops=("write",), error="enospc"))
    writer = SafeStorageWriter(
        f"faulty://{tmp_path}/full", storage_options={"target_protocol": "file", "faults": faults}
    )
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(), checkpoint_id="step_1", storage_writer=writer)
    assert str(info.value).startswith("CheckpointException ranks:dict_keys([0])")
    [(error, _)] = info.value.failures.values()
    assert isinstance(error, dcp_safe.StorageError)
    assert getattr(error.__cause__, "errno", None) == errno.ENOSPC


def test_async_save_futures_raise_the_error_itself(tmp_path: Path, s3: LocalS3) -> None:
    writer = SafeStorageWriter("s3://no-such-bucket/run", storage_options=s3.storage_options())
    future = dcp.async_save(_state(), checkpoint_id="step_1", storage_writer=writer)
    error = pytest.raises(dcp_safe.StorageError, match="bucket does not exist")
    with error as info, translate_errors():
        future.result()
    assert isinstance(info.value.__cause__, CheckpointException)


def test_what_is_no_checkpoint_exception_passes_unchanged() -> None:
    with pytest.raises(KeyError, match="plain"), translate_errors():
        raise KeyError("plain")
