"""``ManagerGroups``: the manager's groups are created at two points only, on every rank alike.

Creating a gloo group is a collective over the default group: a rank that made one from
another thread (a save's upload thread asking for its group while the training thread was
replacing it) met no peer there and failed with the store's raw ``DistStoreError`` (chaos seed
15077: rank 0's save futures held "wait timeout after 3000ms", rank 1's gloo's "connectFullMesh
failed", instead of a typed ``CommitError``). Now only the constructor and ``replace`` create
groups; a lookup meanwhile waits for the new group.
"""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dcp_safe import CheckpointManager
from dcp_safe.coordination.group import discard_group
from dcp_safe.coordination.groups import BACKGROUND, FOREGROUND, POLICY, ManagerGroups
from dcp_safe.errors import CommitError
from dcp_safe.testing.multiproc import run_ranks

pytestmark = pytest.mark.multiproc


def _count_new_groups(monkeypatch_target: Any) -> list[str]:
    made: list[str] = []
    new_group = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(threading.current_thread().name)
        return new_group(*args, **kwargs)

    monkeypatch_target.new_group = counting
    return made


def _lookups_never_create(rank: int, world_size: int) -> dict[str, Any]:
    groups = ManagerGroups(5.0)
    made = _count_new_groups(dist)
    background = groups.group(BACKGROUND)
    # The state inside a replacement, between tearing the old group down and making the new
    # one: the cache of groups no longer holds it.
    discard_group(background, destroy=False)
    looked_up = groups.group(BACKGROUND)
    marked = groups.saw_failure(BACKGROUND, RuntimeError("Connection closed by peer"), background)
    made_by_lookups = list(made)
    groups.replace((BACKGROUND,))
    return {
        "made_by_lookups": made_by_lookups,
        "same_until_replaced": looked_up is background,
        "marked": marked,
        "made_by_replace": len(made) - len(made_by_lookups),
        "replaced": groups.group(BACKGROUND) is not background,
        "others_kept": groups.group(POLICY) is not None and groups.group(FOREGROUND) is not None,
    }


def test_a_lookup_never_creates_a_group_only_the_constructor_and_replace_do() -> None:
    (result,) = run_ranks(_lookups_never_create, 1, timeout_s=120)
    assert result["made_by_lookups"] == []
    assert result["same_until_replaced"]
    assert result["marked"]  # the failure was on the current group: the next vote replaces it
    assert result["made_by_replace"] == 1
    assert result["replaced"] and result["others_kept"]


def _process_groups_reachable_from(root: object) -> int:
    """How many ``ProcessGroup`` objects ``root`` still references (modules' globals excluded)."""
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen, stack, found = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in module_dicts or isinstance(obj, (type, ModuleType)):
            continue
        seen.add(id(obj))
        found += isinstance(obj, dist.ProcessGroup)
        stack.extend(gc.get_referents(obj))
    return found


def _groups_after_close(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, keep_last=1)
    held_while_open = _process_groups_reachable_from(manager)
    handle = manager.save(1, {"w": torch.arange(4.0)})
    assert handle is not None
    manager.close(timeout_s=60)
    try:
        manager._agreement.groups.group(POLICY)  # type: ignore[union-attr]
        later_use = "allowed"
    except CommitError as exc:
        later_use = str(exc)
    return {
        "held_while_open": held_while_open,
        "held_after_close": _process_groups_reachable_from(manager),
        "later_use": later_use,
    }


def test_a_closed_manager_holds_no_process_group(tmp_path: Path) -> None:
    # A gloo group still referenced when the interpreter finalizes is destroyed there, after the
    # job's destroy_process_group(), and its threads can abort the process: CI saw the FSDP
    # example's rank 1 die with "terminate called without an active exception" after "done".
    results = run_ranks(_groups_after_close, 2, args=(str(tmp_path),), timeout_s=120)
    for result in results:
        assert result["held_while_open"] >= 3  # policy, foreground and background groups
        assert result["held_after_close"] == 0
        assert "closed" in result["later_use"]
