"""The exception tree: one root, builtins where they mean the same, DCP's errors translated."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from dcp_safe import errors
from dcp_safe.errors import (
    AdmissionTimeoutError,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    DcpSafeError,
    InvalidCheckpointNameError,
    StorageError,
    from_checkpoint_exception,
)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (CheckpointNotFoundError("/r/x"), FileNotFoundError),
        (CheckpointExistsError("/r/x"), FileExistsError),
        (CheckpointCorruptError("/r/x", "bad"), ValueError),
        (StorageError("write", "/r/x", "disk full"), OSError),
        (AdmissionTimeoutError("waited"), TimeoutError),
        (InvalidCheckpointNameError("a/b", "separator"), ValueError),
    ],
)
def test_errors_share_one_root_and_the_matching_builtin(
    error: Exception, builtin: type[Exception]
) -> None:
    assert isinstance(error, DcpSafeError)
    assert isinstance(error, builtin)


def test_every_public_error_is_a_dcp_safe_error() -> None:
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, DcpSafeError), name


def test_corrupt_error_carries_its_context() -> None:
    error = CheckpointCorruptError(
        "/r/step/__0_0.distcp", "checksum mismatch", item="w@[0]", expected="a", actual="b"
    )
    assert (error.path, error.item, error.expected, error.actual) == (
        "/r/step/__0_0.distcp",
        "w@[0]",
        "a",
        "b",
    )
    assert "w@[0]" in str(error) and "expected a, found b" in str(error)


def test_one_rank_typed_error_is_returned_as_is() -> None:
    inner = CheckpointCorruptError("/p", "bad")
    translated = from_checkpoint_exception(CheckpointException("read", {0: (inner, None)}))
    assert translated is inner
    assert isinstance(translated.__cause__, CheckpointException)


def test_mixed_failures_become_a_commit_error_naming_each_rank() -> None:
    exc = CheckpointException(
        "write",
        {0: (OSError("disk full"), None), 3: (StorageError("put", "s3://b/k", "503"), None)},
    )
    translated = from_checkpoint_exception(exc)
    assert isinstance(translated, CommitError)
    assert set(translated.failures) == {0, 3}
    assert "disk full" in translated.failures[0] and "rank 3" in str(translated)


def test_other_exceptions_pass_through_unchanged(tmp_path: Path) -> None:
    error = ValueError("x")
    assert from_checkpoint_exception(error) is error


def _every_error() -> list[Exception]:
    return [
        DcpSafeError("plain"),
        errors.ConfigError("bad option"),
        InvalidCheckpointNameError("a/b", "separator"),
        CheckpointExistsError("/r/x"),
        CheckpointNotFoundError("/r/x", "no marker"),
        CheckpointCorruptError("/r/x", "bad", item="w@[0]", expected="a", actual="b"),
        CommitError("not published", {1: "OSError: disk full"}),
        errors.StaleWriterError("old attempt", {0: "epoch 3 < 4"}),
        StorageError("fsync", "/r/x", OSError(28, "No space left on device")),
        errors.BudgetExceededError("too big"),
        AdmissionTimeoutError("waited 5 s"),
        errors.DrainTimeoutError("still busy after 5 s"),
        errors.UploadTimeoutError("gave up after 5 s", {1: "did not upload its part"}),
    ]


@pytest.mark.parametrize("error", _every_error(), ids=lambda e: type(e).__name__)
def test_errors_survive_pickling_between_ranks(error: Exception) -> None:
    import pickle

    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert vars(again) == vars(error)


def test_divergence_message_stays_short_with_thousands_of_differing_keys() -> None:
    keys = {f"t{i}": [[0], [1]] for i in range(10_000)}
    message = str(errors.DivergentStateError(keys))
    assert len(message) < 2_000
    assert "and 9980 more" in message
    assert "naming the 10000 prefixes" in message
    assert errors.DivergentStateError({"opt.step": [[0], [1]]}).args[0].count("('opt',)") == 1
