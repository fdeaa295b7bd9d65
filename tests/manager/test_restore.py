"""``CheckpointManager.restore``: every rank gets exactly its own state, only the keys asked for,
and a new run can start from another run's checkpoint.

* The probe of issue 27 under the manager, on real gloo ranks: per-rank RNG and data position
  under plain keys fail the save on every rank with DivergentStateError, nothing published;
  declared ``per_rank`` each rank restores its own.
* ``restore(keys=, exclude=, allow_partial=)`` returns a RestoreReport that says what was
  restored, skipped, missing and not asked for; nothing is skipped silently.
* ``initial_load_from``: a manager whose roots hold nothing warm-starts from another root
  (local and S3), and the history says where the state came from.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_safe import (
    Bounds,
    CheckpointManager,
    Resume,
    Runtime,
    SafeStorageWriter,
    Topology,
    WriterOptions,
    list_checkpoints,
)
from dcp_safe.api_types import RestoreReport
from dcp_safe.errors import DivergentStateError, MissingKeysError, UnsignedCheckpointError
from dcp_safe.manifest.signing import SIGNING_KEY_ENV
from dcp_safe.testing.multiproc import run_ranks


def _probe_state(rank: int, step: int) -> dict[str, Any]:
    torch.manual_seed(1000 * step + rank)
    return {
        "model": {"w": torch.full((4,), float(step))},
        "rng": torch.get_rng_state(),
        "loader": {"pos": 100 * rank + step},
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(4)},
        "rng": torch.zeros_like(torch.get_rng_state()),
        "loader": {"pos": -1},
    }


def _manager_probe(rank: int, world_size: int, root: str, per_rank: tuple[str, ...]) -> Any:
    manager = CheckpointManager(
        root, resume=Resume(per_rank=per_rank), bounds=Bounds(deadline_s=20)
    )
    try:
        saved = _probe_state(rank, 1)
        handle = manager.save(1, saved)
        assert handle is not None
        try:
            handle.committed.result(timeout=120)
        except DivergentStateError as exc:
            return {"refused": sorted(exc.keys)}
        loaded = _blank()
        report = manager.restore(loaded)
        return {
            "name": str(report),
            "own_rng": torch.equal(loaded["rng"], saved["rng"]),
            "pos": loaded["loader"]["pos"],
            "restored": report.restored,
        }
    finally:
        with contextlib.suppress(DivergentStateError):  # the failed save's error, kept
            manager.close(60)


@pytest.mark.multiproc
def test_the_manager_refuses_per_rank_state_under_plain_keys_on_every_rank(
    tmp_path: Path,
) -> None:
    results = run_ranks(_manager_probe, 2, args=(str(tmp_path), ()))
    assert results == [{"refused": ["loader.pos", "rng"]}] * 2
    assert list_checkpoints(tmp_path) == []


@pytest.mark.multiproc
def test_the_manager_restores_each_ranks_own_per_rank_state(tmp_path: Path) -> None:
    results = run_ranks(_manager_probe, 2, args=(str(tmp_path), ("rng", "loader")))
    assert [r["own_rng"] for r in results] == [True, True]
    assert [r["pos"] for r in results] == [1, 101]
    assert results[0]["restored"] == ("loader.pos", "model.w", "rng")  # plain keys, reported


def test_a_partial_restore_reports_what_it_did_and_a_missing_key_fails(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        handle = manager.save(3, {"model": {"w": torch.ones(4)}, "optim": {"lr": 0.5}})
        assert handle is not None
        handle.committed.result(timeout=60)

        target: dict[str, Any] = {"model": {"w": torch.zeros(4)}, "optim": {"lr": 0.0}}
        report = manager.restore(target, keys=["model"])
        assert isinstance(report, RestoreReport) and report == "step_000000003"
        assert report.restored == ("model.w",) and report.skipped == ("optim.lr",)
        assert torch.equal(target["model"]["w"], torch.ones(4)) and target["optim"]["lr"] == 0.0

        asking: dict[str, Any] = {"model": {"w": torch.zeros(4), "new_head": torch.zeros(2)}}
        with pytest.raises(MissingKeysError, match=r"model\.new_head"):
            manager.restore(asking)
        report = manager.restore(asking, allow_partial=True)
        assert report.missing == ("model.new_head",) and report.unexpected == ("optim.lr",)
        assert torch.equal(asking["model"]["w"], torch.ones(4))
        assert torch.equal(asking["model"]["new_head"], torch.zeros(2))  # left as it was
        restored = [e for e in manager.history() if e["event"] == "restored"]
        assert [e["tier"] for e in restored] == ["local", "local"]


def _warm_start(root: str, source: str, options: dict[str, Any] | None) -> None:
    with CheckpointManager(Topology.of(source, storage_options=options)) as donor:
        for step in (10, 20):
            handle = donor.save(step, {"model": {"w": torch.full((4,), float(step))}, "step": step})
            assert handle is not None
    with CheckpointManager(
        Topology.of(root, storage_options=options),
        resume=Resume(initial_load_from=source, initial_load_keys=("model",)),
    ) as manager:
        target: dict[str, Any] = {"model": {"w": torch.zeros(4)}, "step": 0}
        report = manager.restore(target)
        assert report == "step_000000020" and report.skipped == ("step",)
        assert torch.equal(target["model"]["w"], torch.full((4,), 20.0)) and target["step"] == 0
        [event] = [e for e in manager.history() if e["event"] == "restored"]
        assert event["tier"] == "initial" and "warm start from" in event["reason"]
        assert source.rstrip("/") in event["reason"]
        handle = manager.save(21, target)  # the new run's own checkpoints from here on
        assert handle is not None
        handle.committed.result(timeout=60)
        target["model"]["w"].zero_()
        assert manager.restore(target) == "step_000000021"  # its own, no longer the donor's
    named = f"{source.rstrip('/')}/step_000000010"
    with CheckpointManager(
        Topology.of(f"{root}-b", storage_options=options), resume=Resume(initial_load_from=named)
    ) as m:
        target = {"model": {"w": torch.zeros(4)}, "step": 0}
        assert m.restore(target) == "step_000000010" and target["step"] == 10


def test_a_new_run_warm_starts_from_another_runs_checkpoint(tmp_path: Path) -> None:
    _warm_start(str(tmp_path / "run2"), str(tmp_path / "run1"), None)


@pytest.mark.s3
def test_a_new_run_warm_starts_from_another_runs_checkpoint_on_s3(
    s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    _warm_start(f"s3://{s3_bucket}/run2", f"s3://{s3_bucket}/run1", s3_options)


KEY = "hex:" + "5a" * 32


@pytest.mark.parametrize("key_in", ["writer", "environment"])
def test_a_signing_manager_does_not_warm_start_from_an_unsigned_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key_in: str
) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    planted = tmp_path / "planted"  # written by someone without the key
    with CheckpointManager(planted) as donor:
        handle = donor.save(5, {"model": {"w": torch.full((4,), 666.0)}})
        assert handle is not None
    root = tmp_path / "run"
    if key_in == "environment":
        monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
        manager = CheckpointManager(root, resume=Resume(initial_load_from=planted))
    else:
        writer = SafeStorageWriter(root, options=WriterOptions(signing_key=KEY))
        manager = CheckpointManager(
            root, runtime=Runtime(writer=writer), resume=Resume(initial_load_from=planted)
        )
    target = {"model": {"w": torch.zeros(4)}}
    with manager, pytest.raises(UnsignedCheckpointError, match="no _SIGNATURE"):
        manager.restore(target)
    assert torch.equal(target["model"]["w"], torch.zeros(4))
