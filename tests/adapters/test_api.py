"""dcp_safe.save / load: what a failed load says (DCP's planner errors, translated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dcp_safe
from dcp_safe import CheckpointManager, Runtime, SafeStorageReader, SafeStorageWriter
from dcp_safe.errors import LoadError


def _assert_says_the_load_failed(error: LoadError, name: str) -> None:
    message = str(error)
    assert message.startswith(f"load of {name} failed on rank 0: ValueError: Size mismatch")
    assert "published" not in message
    assert error.checkpoint == name and list(error.failures) == [0]


def test_a_load_into_the_wrong_shape_says_the_load_failed_with_its_cause(tmp_path: Path) -> None:
    dcp_safe.save(
        {"w": torch.zeros(4)}, checkpoint_id="step_1", storage_writer=SafeStorageWriter(tmp_path)
    )

    with pytest.raises(LoadError) as caught:
        dcp_safe.load(
            {"w": torch.zeros(5)},
            checkpoint_id="step_1",
            storage_reader=SafeStorageReader(tmp_path),
        )

    _assert_says_the_load_failed(caught.value, "step_1")


def test_a_restore_into_the_wrong_shape_says_the_load_failed_with_its_cause(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path, runtime=Runtime(executor="thread")) as manager:
        manager.save(1, {"w": torch.zeros(4)}).committed.result(60)

        with pytest.raises(LoadError) as caught:
            manager.restore({"w": torch.zeros(5)}, 1)

    _assert_says_the_load_failed(caught.value, "step_000000001")
