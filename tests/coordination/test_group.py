"""The dedicated checkpoint group: cached per deadline, apart from training, failures typed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import ConfigError, SafeStorageReader, SafeStorageWriter
from dcp_safe.coordination.group import (
    checkpoint_group,
    collective_failure,
    is_collective_failure,
    validate_deadline,
)
from dcp_safe.testing.multiproc import run_ranks


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "5", None, True])
def test_a_deadline_that_is_not_a_positive_number_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="deadline_s"):
        validate_deadline(bad)


@pytest.mark.parametrize("call", ["save", "async_save", "load"])
def test_every_api_call_refuses_a_bad_deadline_before_touching_storage(
    tmp_path: Path, call: str
) -> None:
    kwargs: dict[str, Any] = {"checkpoint_id": "step_1", "deadline_s": 0}
    if call == "load":
        kwargs["storage_reader"] = SafeStorageReader(tmp_path)
    else:
        kwargs["storage_writer"] = SafeStorageWriter(tmp_path)
    with pytest.raises(ConfigError, match="deadline_s"):
        getattr(dcp_safe, call)(make_state(0), **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_group_needs_a_default_group() -> None:
    with pytest.raises(ConfigError, match="process group"):
        checkpoint_group(5.0)


def test_a_failed_collective_without_storage_evidence_names_every_peer() -> None:
    cause = RuntimeError("Connection closed by peer [127.0.0.1]:4711\nmore detail")
    error = collective_failure(cause, rank=1, world_size=3, deadline_s=7.0, witnesses=())

    assert sorted(error.failures) == [0, 2]
    assert "RuntimeError: Connection closed by peer" in error.failures[0]
    assert "more detail" not in error.failures[0]
    assert "7 s deadline" in str(error)
    assert error.__cause__ is cause


GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:18356: Connection reset by peer."
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
    "Timed out waiting 8000ms for send operation to complete"
)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError(GLOO_RESET), True),
        (RuntimeError(GLOO_TIMEOUT), True),
        (dist.DistNetworkError("store unreachable"), True),
        (RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"), False),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB; timed out"), False),
        (ValueError("connection closed"), False),
    ],
)
def test_only_transport_errors_count_as_a_failed_collective(
    error: BaseException, expected: bool
) -> None:
    assert is_collective_failure(error) is expected


class _Witness:
    def __init__(self, missing: list[int] | None) -> None:
        self.missing = missing

    def missing_ranks(self) -> list[int] | None:
        return self.missing


def test_a_failed_collective_names_the_ranks_storage_says_did_not_finish() -> None:
    cause = RuntimeError("Timed out waiting 7000ms for recv operation to complete")
    error = collective_failure(
        cause, rank=0, world_size=4, deadline_s=7.0, witnesses=(_Witness(None), _Witness([3, 1]))
    )

    assert list(error.failures) == [1, 3]
    assert "did not finish its part of the save" in error.failures[1]
    assert str(error).startswith("save was not published: a peer died")


class _SlowPeer:
    """Storage as a save sees it when a live peer finishes its manifest just after the dead
    peer's connection dropped: rank 1 is missing at first, then only rank 2 is."""

    def __init__(self, finishes_after: int) -> None:
        self.reads = 0
        self.finishes_after = finishes_after

    def missing_ranks(self) -> list[int]:
        self.reads += 1
        return [1, 2] if self.reads <= self.finishes_after else [2]


def test_a_live_peer_still_writing_its_manifest_is_not_named_with_the_dead_one() -> None:
    cause = RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    witness = _SlowPeer(finishes_after=3)
    error = collective_failure(cause, rank=0, world_size=4, deadline_s=8.0, witnesses=(witness,))

    assert list(error.failures) == [2]
    assert witness.reads > 3


def test_a_failed_load_collective_says_the_load_failed_not_that_a_save_was_unpublished() -> None:
    cause = RuntimeError("Connection closed by peer")
    error = collective_failure(
        cause, rank=1, world_size=2, deadline_s=5.0, witnesses=(), operation="load"
    )

    assert str(error).startswith("load did not complete: a peer died or did not respond")
    assert "published" not in str(error)
    assert list(error.failures) == [0] and error.__cause__ is cause


# --------------------------------------------------------------- multi-rank


def _group_facts_and_busy_training(rank: int, world_size: int, root: str) -> dict[str, Any]:
    group = checkpoint_group(30.0)
    facts: dict[str, Any] = {
        "cached": checkpoint_group(30.0) is group,
        "other_deadline_is_other_group": checkpoint_group(31.0) is not group,
        "not_default": group is not dist.group.WORLD,
        "backend": dist.get_backend(group),
        "size": dist.get_world_size(group),
    }
    # A background save whose collectives run while this thread keeps issuing training
    # collectives on the default group: on one shared gloo group the two streams would pair up
    # wrongly (or deadlock); on the dedicated group they cannot meet.
    future = dcp_safe.async_save(
        make_state(0), checkpoint_id="busy", storage_writer=SafeStorageWriter(root)
    )
    sums = []
    for step in range(50):
        value = torch.tensor([float(rank + step)])
        dist.all_reduce(value)
        sums.append(value.item())
    future.result()
    facts["sums_ok"] = sums == [float(sum(r + s for r in range(world_size))) for s in range(50)]
    target = blank_like(make_state(0))
    dcp_safe.load(target, checkpoint_id="busy", storage_reader=SafeStorageReader(root))
    facts["loaded"] = target
    return facts


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_saves_run_on_a_cached_gloo_group_apart_from_training_collectives(tmp_path: Path) -> None:
    per_rank = run_ranks(_group_facts_and_busy_training, 2, args=(str(tmp_path),), timeout_s=240)

    for facts in per_rank:
        assert facts["cached"] and facts["other_deadline_is_other_group"] and facts["not_default"]
        assert (facts["backend"], facts["size"]) == ("gloo", 2)
        assert facts["sums_ok"]
        assert_state_equal(facts["loaded"], make_state(0))
    assert [info.name for info in dcp_safe.list_checkpoints(tmp_path)] == ["busy"]
