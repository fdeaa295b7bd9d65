"""A signing manager's retention and restores cannot be turned by what others plant in its roots.

Whoever can write a root can add committed-looking checkpoints with higher steps (and history
lines saying they were validated). With a signing key, only what the key signed counts: for
``latest``, for retention on both tiers, and for every reader the manager builds; and a manager
never deletes the newest checkpoint it committed itself, whatever a listing says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import dcp_safe
from dcp_safe import CheckpointManager, Runtime, SafeStorageWriter, WriterOptions, list_checkpoints
from dcp_safe.checkpoints.history import HISTORY_FILE

KEY = b"k" * 32


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(step)), "step": step}


def _plant(root: Path, step: int) -> None:
    """An unsigned checkpoint with a higher step, and a history line vouching for it."""
    name = f"step_{step:09d}"
    writer = SafeStorageWriter(root, step=step)
    dcp_safe.save(_state(step), checkpoint_id=name, storage_writer=writer)
    line = {"event": "committed", "step": step, "name": name, "tier": "local", "validated": True}
    with (root / HISTORY_FILE).open("a") as history:
        history.write(json.dumps({**line, "time": 1.0}) + "\n")


def test_planted_unsigned_checkpoints_never_push_signed_ones_out(tmp_path: Path) -> None:
    root, replica = tmp_path / "local", tmp_path / "replica"
    writer = SafeStorageWriter(root, replicate_to=replica, options=WriterOptions(signing_key=KEY))
    with CheckpointManager(root, keep_last=2, runtime=Runtime(writer=writer)) as manager:
        for step in (1, 2, 3):
            handle = manager.save(step, _state(step))
            assert handle is not None
            handle.replicated.result(timeout=60)
        for where in (root, replica):
            _plant(where, 100)
            _plant(where, 101)
        handle = manager.save(4, _state(4))  # its retention runs over the planted ones
        assert handle is not None
        handle.replicated.result(timeout=60)
        manager.prune()
        assert manager.latest() == "step_000000004"
        target = _state(0)
        assert manager.restore(target) == "step_000000004" and target["step"] == 4
    for where in (root, replica):
        signed = [c.name for c in list_checkpoints(where, signing_key=KEY)]
        assert signed == ["step_000000003", "step_000000004"], where  # keep_last=2 signed
        everything = {c.name for c in list_checkpoints(where)}
        assert {"step_000000100", "step_000000101"} <= everything  # not ours: left alone


def test_a_signing_manager_never_restores_an_unsigned_forgery(tmp_path: Path) -> None:
    writer = SafeStorageWriter(tmp_path, options=WriterOptions(signing_key=KEY))
    with CheckpointManager(tmp_path, runtime=Runtime(writer=writer)) as manager:
        handle = manager.save(5, _state(5))
        assert handle is not None
        handle.committed.result(timeout=60)
        _plant(tmp_path, 50)  # newer by step, unsigned
        target = _state(0)
        report = manager.restore(target)
        assert report == "step_000000005" and target["step"] == 5
