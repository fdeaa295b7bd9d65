"""A poisoned state dict fails DCP's planning, so one rank's staging failure fails every rank.

The multi-rank behaviour is specified in ``test_guard_multirank.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from dcp_safe import SafeStorageWriter, list_checkpoints
from dcp_safe.errors import BudgetExceededError, SnapshotMutatedError
from dcp_safe.staging.poison import POISON_KEY, poisoned


@pytest.mark.parametrize(
    "error", [SnapshotMutatedError(["model.w"], rank=3), BudgetExceededError("too big")]
)
def test_a_poisoned_state_fails_in_dcps_planner_without_writing(
    tmp_path: Path, error: Exception
) -> None:
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException
        dcp.save(poisoned(error), storage_writer=SafeStorageWriter(tmp_path), checkpoint_id="p")
    failures = caught.value.failures  # type: ignore[attr-defined]
    [(cause, _)] = failures.values()
    assert cause is error or type(cause) is type(error)
    assert list_checkpoints(tmp_path) == []
    assert POISON_KEY.startswith("__dcp_safe")
