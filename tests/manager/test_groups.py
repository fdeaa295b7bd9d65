"""``ManagerGroups``: the manager's groups are created at two points only, on every rank alike.

Creating a gloo group is a collective over the default group: a rank that made one from
another thread (a save's upload thread asking for its group while the training thread was
replacing it) met no peer there and failed with the store's raw ``DistStoreError`` (chaos seed
15077: rank 0's save futures held "wait timeout after 3000ms", rank 1's gloo's "connectFullMesh
failed", instead of a typed ``CommitError``). Now only the constructor and ``replace`` create
groups; a lookup meanwhile waits for the new group.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from dcp_safe.dcp.group import discard_group
from dcp_safe.manager.groups import BACKGROUND, FOREGROUND, POLICY, ManagerGroups
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
