"""dcp_safe.torch_checkpointing driven exactly as torchtitan's TorchCheckpointingManager drives a
torch_checkpointing storage (issue #45, docs/torch_checkpointing.md, "torchtitan").

torchtitan is not installed here, so its calls are reproduced, each citing where it makes them
(pytorch/torchtitan, read with the code search at commits 023baf5 and 091ca6d):

* ``components/checkpointer/torch_checkpointing.py``, ``_BackendCheckpointStorage``: every path
  probe goes through the backend's ``Storage``: ``isdir(p)`` is ``storage.isdir(Path(p))``,
  ``isfile(p)`` is ``storage.exists(Path(p)) and not storage.isdir(Path(p))``, ``listdir(p)`` is
  ``storage.ls(Path(p))`` and ``remove(p)`` is ``storage.rmdir(Path(p))``.
* ``TorchCheckpointingManager.__init__``: ``self.folder = filesystem.join(base_folder,
  config.folder)``, by default ``./outputs`` + ``checkpoint``: a path relative to the working
  directory; a remote folder is refused there, so with an object-store root torchtitan still
  names a local-looking folder.
* ``base.py``, ``_create_checkpoint_id``: ``filesystem.join(folder, f"step-{step}")``.
* ``base.py``, ``load``: ``isdir(self.folder)``, then ``_find_load_step`` (``isdir(folder)``,
  ``listdir(folder)``, ``re.fullmatch(r"step-(0|[1-9]\\d*)", dirname)``, the resumable check per
  step), then ``isdir(checkpoint_id)``; ``torch_checkpointing.py``, ``_is_valid_checkpoint``:
  ``isfile(join(checkpoint_dir, METADATA_FILE_NAME))`` (or the HF index), and ``_load``:
  ``self._manager.load(checkpoint_id, into=..., strict=True)``.
* ``base.py``, ``_purge_stale_checkpoints`` (rank 0, ``keep_latest_k > 0``, ``isdir(folder)``):
  ``listdir(folder)``; ``<temp_dir_prefix>step-N`` entries and step folders that fail
  ``_is_valid_checkpoint`` are abandoned; the oldest valid ones beyond ``keep_latest_k - 1`` and
  the abandoned ones are each passed to ``remove``, on the purge thread.
* ``torch_checkpointing.py``, ``_save``: ``self._manager.save(self._create_checkpoint_id(step),
  state)``.

What torchtitan builds itself and these tests take from ``manager_config`` instead: its
``CheckpointManager.Config`` (``_default_backend_config``) sets neither this storage's
pre-finalize and finalize callbacks nor ``write_to_temp_dir=False`` (docs: the gap that stays).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing")

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_writer import DEFAULT_TEMP_DIR_PREFIX
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.metadata_serialization import METADATA_FILE_NAME  # "metadata.pkl"
from torch_checkpointing.storage.base_storage import Storage

import dcp_safe
from dcp_safe.errors import ConfigError
from dcp_safe.topology import Root
from dcp_safe.torch_checkpointing import SafeStorageConfig, manager_config

STEP_DIR = r"step-(0|[1-9]\d*)"  # BaseCheckpointManager._STEP_DIR_PATTERN


class TitanProbes:
    """torchtitan's ``_BackendCheckpointStorage``: its four probes, as it makes them."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    def isdir(self, path: str) -> bool:
        return self._storage.isdir(Path(path))

    def isfile(self, path: str) -> bool:
        return self._storage.exists(Path(path)) and not self._storage.isdir(Path(path))

    def listdir(self, path: str) -> list[str]:
        return self._storage.ls(Path(path))

    def remove(self, path: str) -> None:
        self._storage.rmdir(Path(path))


def _is_valid(probes: TitanProbes, checkpoint_dir: str) -> bool:
    return probes.isfile(os.path.join(checkpoint_dir, METADATA_FILE_NAME)) or probes.isfile(
        os.path.join(checkpoint_dir, "model.safetensors.index.json")
    )


def _find_load_step(probes: TitanProbes, folder: str) -> int:
    if not probes.isdir(folder):
        return -1
    steps = []
    for dirname in probes.listdir(folder):
        match = re.fullmatch(STEP_DIR, dirname)
        if match is not None and _is_valid(probes, os.path.join(folder, dirname)):
            steps.append(int(match.group(1)))
    return max(steps) if steps else -1


def _purge(probes: TitanProbes, folder: str, saving_step: int, keep_latest_k: int) -> list[str]:
    """What ``_purge_stale_checkpoints`` hands its purge thread, each one removed here."""
    if not probes.isdir(folder):
        return []
    saving = {f"step-{saving_step}", f"{DEFAULT_TEMP_DIR_PREFIX}step-{saving_step}"}
    staging = re.compile(rf"{re.escape(DEFAULT_TEMP_DIR_PREFIX)}{STEP_DIR}")
    valid: list[tuple[int, str]] = []
    abandoned: list[str] = []
    for dirname in probes.listdir(folder):
        if dirname in saving:
            continue
        checkpoint_dir = os.path.join(folder, dirname)
        if staging.fullmatch(dirname):
            abandoned.append(checkpoint_dir)
            continue
        match = re.fullmatch(STEP_DIR, dirname)
        if match is None:
            continue
        if _is_valid(probes, checkpoint_dir):
            valid.append((int(match.group(1)), checkpoint_dir))
        else:
            abandoned.append(checkpoint_dir)
    valid.sort()
    doomed = [path for _, path in valid[: max(0, len(valid) - (keep_latest_k - 1))]] + abandoned
    for path in doomed:
        probes.remove(path)
    return doomed


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(8, 4, generator=gen)}, "step": step}


def _manager(root: Path | Root, folder: str | None) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=DefaultResharder(), required=False)}
    return CheckpointManager(manager_config(root, save="sync", folder=folder, items=items))


@pytest.mark.parametrize(
    "where", ["root_is_the_folder", "root_elsewhere", pytest.param("s3", marks=pytest.mark.s3)]
)
def test_torchtitan_folder_ids_probes_retention_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, where: str
) -> None:
    """torchtitan's relative ``./outputs/checkpoint/step-N`` ids name checkpoints under the
    root: the folder probes as a directory that lists committed steps only, each step passes
    its validity check, retention removes the oldest through ``rmdir``, a restart finds and
    loads the newest; the same catalogue is dcp_safe's."""
    monkeypatch.chdir(tmp_path)
    folder = os.path.join("./outputs", "checkpoint")  # filesystem.join(base_folder, folder)
    root: Path | Root
    if where == "root_is_the_folder":
        root, mapped = tmp_path / "outputs" / "checkpoint", None  # a local root is its folder
    elif where == "root_elsewhere":  # as with an object-store root, which torchtitan cannot name
        root, mapped = tmp_path / "elsewhere", folder
    else:
        options = request.getfixturevalue("s3_options")
        root, mapped = Root(request.getfixturevalue("s3_root"), options), folder
    probes = TitanProbes(SafeStorageConfig(root, folder=mapped).create_storage())

    assert probes.isdir(folder) and probes.listdir(folder) == []
    assert _find_load_step(probes, folder) == -1  # a fresh start

    for step in (10, 20, 30):
        purged = _purge(probes, folder, saving_step=step, keep_latest_k=2)
        assert purged == ([os.path.join(folder, "step-10")] if step == 30 else [])
        # A manager per save: torchtitan's async saver writes metadata.pkl with every save
        # (its subprocess keeps it), a sync saver only with a manager's first.
        mgr = _manager(root, mapped)
        try:
            mgr.save(os.path.join(folder, f"step-{step}"), _state(step))
        finally:
            mgr.close()

    assert probes.listdir(folder) == ["step-20", "step-30"]
    assert [c.name for c in dcp_safe.list_checkpoints(root)] == ["step-20", "step-30"]
    assert not (tmp_path / "outputs" / "checkpoint" / "step-10").exists()
    assert not probes.isdir(os.path.join(folder, "step-10"))
    assert probes.isdir(os.path.join(folder, "step-30"))
    assert not probes.isfile(os.path.join(folder, "step-30"))

    step = _find_load_step(probes, folder)  # the restarted job
    assert step == 30
    checkpoint_id = os.path.join(folder, f"step-{step}")
    assert probes.isdir(checkpoint_id) and _is_valid(probes, checkpoint_id)
    into = {"model": {"w": torch.zeros(8, 4)}, "step": None}
    mgr = _manager(root, mapped)
    try:
        loaded = mgr.load(checkpoint_id, into=into, strict=True)
    finally:
        mgr.close()
    assert torch.equal(loaded["model"]["w"], _state(30)["model"]["w"])
    assert loaded["step"] == 30


def test_paths_map_to_names_only_under_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder (absolute, or relative from a working directory outside it) stands for the
    root; a bare relative path is a name under the root; anything else is refused."""
    root = tmp_path / "root"
    monkeypatch.chdir(tmp_path)
    storage = SafeStorageConfig(root).create_storage()
    assert storage._rel(root) == storage._rel("root") == storage._rel("./root/") == ""
    assert storage._rel(root / "step-1" / "model_0.pt") == "step-1/model_0.pt"
    assert storage._rel("root/step-1") == "step-1"
    assert storage._rel("step-1") == "step-1"  # not under the folder from here: a name
    for outside in (tmp_path / "other" / "step-1", "../step-1", tmp_path):
        with pytest.raises(ConfigError, match="not a checkpoint path under the root"):
            storage._rel(outside)

    root.mkdir()
    monkeypatch.chdir(root)  # inside the folder, a relative path stays a name
    assert storage._rel("step-1") == "step-1" and storage._rel(".") == ""


def test_a_write_to_the_folder_itself_is_refused(tmp_path: Path) -> None:
    """The root is no checkpoint: a save of the folder's own path claims nothing."""
    storage = SafeStorageConfig(tmp_path / "root").create_storage()
    with pytest.raises(ConfigError, match="names no checkpoint"):
        storage.mkdir(tmp_path / "root")
    assert storage.ls(tmp_path / "root") == []
