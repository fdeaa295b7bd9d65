"""``Agreement.settle``: the coordinator's result, or its failure, on every rank."""

from __future__ import annotations

import pytest

from dcp_safe.coordination.agreement import Agreement
from dcp_safe.coordination.groups import ManagerGroups
from dcp_safe.errors import CommitError
from dcp_safe.testing.multiproc import run_ranks

pytestmark = pytest.mark.multiproc


class _Stopped(BaseException):
    """Not an Exception, as DCP's CheckpointException is not."""


def _stop() -> str:
    raise _Stopped("listing interrupted")


def _settle_stopped(rank: int, world_size: int) -> tuple[str, str, list[int]]:
    agreement = Agreement(ManagerGroups(10.0))
    try:
        agreement.settle("restore", -1, _stop, 10.0)
    except BaseException as exc:
        return type(exc).__name__, str(exc), sorted(getattr(exc, "failures", {}))
    finally:
        agreement.release()
    return "returned", "", []


def test_a_base_exception_on_the_coordinator_is_raised_there_and_typed_on_every_peer() -> None:
    coordinator, peer = run_ranks(_settle_stopped, 2, timeout_s=120)
    # Before: nothing was recorded, and every rank failed unpacking None (a TypeError).
    assert coordinator[:2] == ("_Stopped", "listing interrupted")
    assert peer[0] == CommitError.__name__
    assert "restore" in peer[1] and "listing interrupted" in peer[1]
    assert peer[2] == [0]
