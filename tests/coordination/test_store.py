"""The store's barrier and verdicts, over an in-process store: one outcome on every rank."""

from __future__ import annotations

from typing import Any

# torch re-exports it from its C extension without listing it: strict mypy rejects that.
from torch.distributed import HashStore  # type: ignore[attr-defined]

from dcp_safe.coordination.store import PromotionBarrier, Verdicts, wait_for
from dcp_safe.errors import CommitError


def _barrier(store: object, rank: int, *, world_size: int = 2) -> PromotionBarrier:
    return PromotionBarrier(store, "t", rank=rank, world_size=world_size, timeout_s=0.05)


def test_the_last_rank_to_arrive_lets_every_rank_through() -> None:
    store: Any = HashStore()
    store.append("dcp_safe/manager/t/coalesced/1/arrived", "1,")
    store.add("dcp_safe/manager/t/coalesced/1/count", 1)  # rank 1 arrived first
    assert _barrier(store, 0).cross(1, step=7) is None


def test_a_barrier_not_complete_in_time_is_abandoned_naming_the_missing_rank() -> None:
    store = HashStore()
    why = _barrier(store, 0).cross(3, step=7)
    assert why is not None
    assert "coalesced save of step 7 dropped on every rank" in why
    assert "rank(s) 1 had not finished their previous save" in why
    # The outcome is decided once: a late rank reads the same abandonment.
    assert _barrier(store, 1).cross(3, step=7) is not None


def test_an_abandoned_barrier_stops_every_rank() -> None:
    store = HashStore()
    _barrier(store, 1).abandon(2)
    why = _barrier(store, 0).cross(2, step=5)
    assert why is not None and "step 5" in why


def test_the_coordinators_verdict_reaches_the_other_ranks() -> None:
    store = HashStore()
    coordinator = Verdicts(store, "t", coordinator=True, timeout_s=0.05)
    other = Verdicts(store, "t", coordinator=False, timeout_s=0.05)
    ok, failed = coordinator.key_for("step_1"), coordinator.key_for("step_1")
    assert (other.key_for("step_1"), other.key_for("step_1")) == (ok, failed)
    coordinator.post(ok, None)
    coordinator.post(failed, OSError("disk gone"))
    assert other.await_verdict(ok) is None
    error = other.await_verdict(failed)
    assert isinstance(error, CommitError)
    assert error.failures == {0: "OSError: disk gone"}


def test_no_verdict_in_time_is_a_commit_error_naming_rank_0() -> None:
    other = Verdicts(HashStore(), "t", coordinator=False, timeout_s=0.05)
    error = other.await_verdict(other.key_for("step_1"))
    assert isinstance(error, CommitError)
    assert list(error.failures) == [0]
    assert "within 0.05 s" in error.failures[0]


def test_a_store_wait_reports_its_timeout_rather_than_raising() -> None:
    store = HashStore()
    assert wait_for(store, "missing", 0.05) is False
    store.set("there", "1")
    assert wait_for(store, "there", 0.05) is True


def test_a_verdict_posted_after_a_peer_gave_up_loses_on_every_rank() -> None:
    store = HashStore()
    coordinator = Verdicts(store, "t", coordinator=True, timeout_s=0.05)
    other = Verdicts(store, "t", coordinator=False, timeout_s=0.05)
    key = other.key_for("step_1")
    assert coordinator.key_for("step_1") == key
    gave_up = other.await_verdict(key)  # no verdict yet: rank 1 claims the key failed
    assert isinstance(gave_up, CommitError)
    adopted = coordinator.post(key, None)  # the coordinator's late "ok" loses
    assert isinstance(adopted, CommitError)
    assert str(adopted) == str(gave_up)
    assert "within 0.05 s" in adopted.failures[0]


def test_a_verdict_posted_in_time_wins_over_a_later_claim() -> None:
    store = HashStore()
    coordinator = Verdicts(store, "t", coordinator=True, timeout_s=0.05)
    other = Verdicts(store, "t", coordinator=False, timeout_s=0.05)
    key = coordinator.key_for("step_1")
    assert coordinator.post(key, None) is None
    store.compare_set(key, "", "expired:0.05")  # a claim after the verdict changes nothing
    assert other.await_verdict(other.key_for("step_1")) is None
