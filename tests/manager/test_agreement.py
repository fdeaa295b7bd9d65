"""The decision every rank takes from every rank's vote: pure rules, no process group needed."""

from __future__ import annotations

import pytest

from dcp_safe.coordination.agreement import Agreement, Vote, groups_to_replace
from dcp_safe.errors import ConfigError
from dcp_safe.manager.handles import BusyPolicy
from dcp_safe.manager.saving import Verdict, decide


def _votes(*busy: bool, step: int = 4, **extra: object) -> list[Vote]:
    return [Vote("save", step, busy=b, **extra) for b in busy]  # type: ignore[arg-type]


def test_no_rank_busy_starts_on_every_policy() -> None:
    for policy in BusyPolicy:
        assert decide(_votes(False, False, False), policy).verdict is Verdict.START


@pytest.mark.parametrize(
    ("policy", "verdict"),
    [
        (BusyPolicy.SKIP, Verdict.SKIP),
        (BusyPolicy.RAISE, Verdict.RAISE),
        (BusyPolicy.SYNC, Verdict.SYNC),
        (BusyPolicy.WAIT, Verdict.WAIT),
        (BusyPolicy.COALESCE, Verdict.COALESCE),
    ],
)
def test_one_busy_rank_applies_when_busy_on_every_rank(
    policy: BusyPolicy, verdict: Verdict
) -> None:
    decision = decide(_votes(False, True, False), policy)
    assert decision.verdict is verdict
    assert "rank 1" in decision.reason


def test_coalesce_skips_everywhere_when_one_rank_has_no_room_for_the_copy() -> None:
    votes = [Vote("save", 4, busy=True), Vote("save", 4, busy=True, no_room=True)]
    decision = decide(votes, BusyPolicy.COALESCE)
    assert decision.verdict is Verdict.SKIP
    assert "no memory for a pending copy on rank 1" in decision.reason


def test_coalesce_replaces_a_pending_save_only_where_every_rank_still_holds_it() -> None:
    same = [Vote("save", 9, busy=True, pending=5), Vote("save", 9, busy=True, pending=5)]
    assert decide(same, BusyPolicy.COALESCE).verdict is Verdict.COALESCE
    # Rank 1 already took step 5 out to start it: replacing it on rank 0 alone would run
    # different saves on the two ranks, so the new request is skipped everywhere.
    split = [Vote("save", 9, busy=True, pending=5), Vote("save", 9, busy=True)]
    decision = decide(split, BusyPolicy.COALESCE)
    assert decision.verdict is Verdict.SKIP
    assert "already starting on rank 1" in decision.reason


def test_every_rank_replaces_the_groups_any_rank_saw_break() -> None:
    votes = [Vote("save", 4, broken=("manager-async",)), Vote("save", 4, busy=True)]
    assert groups_to_replace(votes) == ("manager-async",)
    both = [Vote("wait", 4, broken=("manager-sync",)), Vote("wait", 4, broken=("manager-async",))]
    assert groups_to_replace(both) == ("manager-async", "manager-sync")
    assert groups_to_replace(_votes(False, False)) == ()


def test_a_single_process_waits_in_one_round_and_reports_who_is_still_busy() -> None:
    solo = Agreement()
    waited: list[float] = []

    def never_ready(wait_s: float) -> bool:
        waited.append(wait_s)
        return False

    assert solo.until_all("wait", 3, never_ready, 0.01) == [0]
    assert waited == [pytest.approx(0.01, abs=0.01)]
    assert solo.until_all("wait", 3, lambda _: True, 0.01) == []


def test_a_fallback_on_one_rank_makes_every_rank_save_synchronously() -> None:
    votes = [Vote("save", 4), Vote("save", 4, fallback="memory below the reserve")]
    decision = decide(votes, BusyPolicy.SKIP)
    assert decision.verdict is Verdict.SYNC
    assert decision.fallback == "rank 1: memory below the reserve"


def test_a_stalled_save_in_flight_skips_rather_than_waits() -> None:
    votes = [Vote("save", 4, busy=True, stalled="the save in flight is 90 s old"), Vote("save", 4)]
    assert decide(votes, BusyPolicy.WAIT).verdict is Verdict.SKIP
    assert decide(votes, BusyPolicy.RAISE).verdict is Verdict.RAISE


def test_ranks_asking_for_different_steps_raise_a_config_error_naming_them() -> None:
    votes = [Vote("save", 4), Vote("save", 4), Vote("save", 5)]
    with pytest.raises(ConfigError, match=r"rank 2: save\(step 5\)"):
        decide(votes, BusyPolicy.WAIT)
    with pytest.raises(ConfigError, match=r"rank 1: restore"):
        decide([Vote("save", 4), Vote("restore", 4)], BusyPolicy.WAIT)


def test_a_single_process_exchanges_nothing_and_settles_locally() -> None:
    solo = Agreement()
    vote = Vote("save", 1, busy=True)
    assert solo.gather(vote) == [vote]
    assert solo.coordinator and not solo.distributed
    assert solo.settle("restore", -1, lambda: "step_1", 30.0) == "step_1"
    with pytest.raises(ConfigError, match="boom"):
        solo.settle("restore", -1, _raise_config_error, 30.0)


def _raise_config_error() -> str:
    raise ConfigError("boom")
