"""Retention policies: pure keep/drop decisions, and the safety rules no policy overrides."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_safe import Retention
from dcp_safe.errors import ConfigError
from dcp_safe.retention.policy import (
    CheckpointRecord,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepWithin,
    RetentionPolicy,
    combine,
    decide,
)


def _records(steps: list[int], validated: set[int] | None = None) -> list[CheckpointRecord]:
    return [
        CheckpointRecord(f"step_{s:04d}", s, validated is None or s in validated) for s in steps
    ]


def _steps(names: tuple[str, ...]) -> list[int]:
    return [int(n.removeprefix("step_")) for n in names]


def test_keep_last_and_every_combined_keep_their_union() -> None:
    decision = decide(_records(list(range(1, 11))), combine(KeepLast(2), KeepEvery(5)))
    assert _steps(decision.keep) == [5, 9, 10]
    assert _steps(decision.drop) == [1, 2, 3, 4, 6, 7, 8]


def test_keep_last_keeps_everything_while_there_are_fewer_checkpoints_than_it_keeps() -> None:
    # Found by the chaos run: KeepLast(5) over 4 checkpoints kept only the newest one (a
    # negative slice start), and the safety rules alone kept a second.
    for count in range(6):
        steps = list(range(1, count + 1))
        assert _steps(decide(_records(steps), KeepLast(5)).keep) == steps


def test_nothing_is_dropped_at_or_after_the_newest_validated_checkpoint() -> None:
    decision = decide(_records([1, 2, 3, 4], validated={1, 2}), KeepLast(1))
    assert _steps(decision.keep) == [1, 2, 3, 4]


def test_nothing_is_dropped_while_nothing_is_validated() -> None:
    assert decide(_records([1, 2, 3], validated=set()), KeepLast(0)).drop == ()


def test_protected_names_are_kept() -> None:
    decision = decide(_records([1, 2, 3]), KeepLast(1), protected={"step_0001", "other"})
    # 1 (protected) and 3 (the policy's) are two validated ones: rule 3 has nothing to add.
    assert _steps(decision.keep) == [1, 3]
    assert _steps(decision.drop) == [2]


def test_a_second_validated_checkpoint_is_added_when_the_policy_keeps_only_one() -> None:
    assert _steps(decide(_records([1, 2, 3]), KeepLast(1)).keep) == [2, 3]
    # The newest validated one not yet kept is added, not merely the second newest: 2 is not
    # validated, so it goes and 1 stays.
    decision = decide(_records([1, 2, 3, 4], validated={1, 3}), KeepLast(1))
    assert _steps(decision.keep) == [1, 3, 4]
    assert _steps(decision.drop) == [2]
    # One validated checkpoint in all: it alone is kept by rule 3 (with what follows it).
    assert _steps(decide(_records([1, 2, 3], validated={2}), KeepLast(0)).keep) == [2, 3]


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        KeepLast(-1)
    with pytest.raises(ConfigError):
        KeepEvery(0)
    with pytest.raises(ConfigError):
        decide(_records([1, 1]), KeepLast(1))


_policies = st.one_of(
    st.builds(KeepLast, st.integers(0, 5)),
    st.builds(KeepEvery, st.integers(1, 6)),
    st.lists(
        st.one_of(st.builds(KeepLast, st.integers(0, 5)), st.builds(KeepEvery, st.integers(1, 6))),
        max_size=3,
    ).map(lambda ps: combine(*ps)),
)

_histories = st.lists(
    st.tuples(st.integers(0, 60), st.booleans()), max_size=25, unique_by=lambda t: t[0]
).map(lambda pairs: [CheckpointRecord(f"step_{s:04d}", s, v) for s, v in pairs])


@given(records=_histories, policy=_policies, protected=st.sets(st.integers(0, 60), max_size=5))
def test_safety_rules_hold_for_every_policy(
    records: list[CheckpointRecord], policy: RetentionPolicy, protected: set[int]
) -> None:
    protected_names = {f"step_{s:04d}" for s in protected}
    decision = decide(records, policy, protected=protected_names)
    keep, drop = set(decision.keep), set(decision.drop)
    by_step = sorted(records, key=lambda r: r.step)
    assert keep | drop == {r.name for r in records} and not keep & drop
    if by_step:
        assert by_step[-1].name in keep  # the newest committed
    validated = [r for r in by_step if r.validated]
    newest_validated = validated[-1].step if validated else None
    for record in by_step:
        if record.name in drop:  # only ever older than the newest validated
            assert newest_validated is not None and record.step < newest_validated
    if len(validated) >= 2:
        assert len([r for r in validated if r.name in keep]) >= 2
    assert not drop & protected_names
    assert policy.keeps(by_step) & {r.name for r in records} <= keep  # policy keeps honoured


@given(records=_histories, a=_policies, b=_policies)
def test_combine_never_drops_what_either_policy_keeps(
    records: list[CheckpointRecord], a: RetentionPolicy, b: RetentionPolicy
) -> None:
    names = {r.name for r in records}
    combined = combine(a, b)
    either = (a.keeps(records) | b.keeps(records)) & names
    assert combined.keeps(records) & names == either
    decision = decide(records, combined, protected={"step_0000"})
    keep = set(decision.keep)
    assert either <= keep
    # ... plus the safety rules (not monotone in the policy: rule 3 adds a validated checkpoint
    # only when the policy's keeps hold fewer than two).
    by_step = sorted(records, key=lambda r: r.step)
    validated = [r for r in by_step if r.validated]
    if by_step:
        assert by_step[-1].name in keep
    if validated:
        assert {r.name for r in by_step if r.step >= validated[-1].step} <= keep
    assert len([r for r in validated if r.name in keep]) >= min(2, len(validated))
    assert {"step_0000"} & names <= keep


@given(records=_histories, policy=_policies)
def test_decide_is_order_independent(
    records: list[CheckpointRecord], policy: RetentionPolicy
) -> None:
    assert decide(records, policy) == decide(list(reversed(records)), policy)


# ------------------------------------------------------------------ by metric and by time


def _scored(losses: dict[int, float | str | None]) -> list[CheckpointRecord]:
    return [
        CheckpointRecord(
            f"step_{s:04d}", s, True, created_at=100.0 * s, metrics=None if v is None else {"l": v}
        )
        for s, v in sorted(losses.items())
    ]


@given(
    st.dictionaries(st.integers(1, 60), st.floats(-1e6, 1e6), min_size=1, max_size=30),
    st.integers(1, 5),
    st.sampled_from(["min", "max"]),
)
def test_keep_best_keeps_the_k_best_and_decide_adds_only_the_safety_rules(
    losses: dict[int, float], k: int, mode: str
) -> None:
    records = _scored(dict(losses))
    best = KeepBest(k, "l", mode)  # type: ignore[arg-type]
    kept = best.keeps(records)
    ranked = sorted(losses, key=lambda s: (losses[s] if mode == "min" else -losses[s], -s))
    assert kept == {f"step_{s:04d}" for s in ranked[:k]}
    decision = decide(records, combine(KeepLast(1), best))
    expected = kept | {records[-1].name}  # every record is validated here
    if len(expected) < 2 and len(records) > 1:  # rule 3: the newest validated not yet kept
        expected |= {records[-2].name}  # _scored orders by step
    assert set(decision.keep) == expected


def test_keep_best_keeps_exactly_the_best_k_and_the_newest_when_those_hold_two_validated() -> None:
    records = _scored({1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0})  # best two: 2 and 4
    decision = decide(records, combine(KeepLast(1), KeepBest(2, "l")))
    assert _steps(decision.keep) == [2, 4, 6]  # 5, the second newest, is not kept
    assert _steps(decision.drop) == [1, 3, 5]


def test_keep_best_passes_by_a_missing_metric_and_a_label() -> None:
    records = _scored({1: 0.5, 2: None, 3: "n/a", 4: 0.1})
    assert KeepBest(3, "l").keeps(records) == {"step_0001", "step_0004"}
    assert KeepBest(1, "l", "max").keeps(records) == {"step_0001"}


def test_ties_go_to_the_newer_checkpoint() -> None:
    assert KeepBest(1, "l").keeps(_scored({1: 0.5, 2: 0.5, 3: 0.9})) == {"step_0002"}


def test_keep_within_counts_from_the_newest_checkpoint_not_from_now() -> None:
    records = _scored(dict.fromkeys(range(1, 11), 0.0))  # committed at 100 s, 200 s, ...
    assert _steps(tuple(sorted(KeepWithin(250.0).keeps(records)))) == [8, 9, 10]
    assert KeepWithin(0.0).keeps(records) == {"step_0010"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepBest(0, "l"),
        lambda: KeepBest(True, "l"),  # type: ignore[arg-type]
        lambda: KeepBest(1, ""),
        lambda: KeepBest(1, "l", "median"),  # type: ignore[arg-type]
        lambda: KeepWithin(-1.0),
        lambda: KeepWithin(float("nan")),
        lambda: KeepWithin(float("inf")),
        lambda: Retention(keep_best=(2, "l", "avg")),  # type: ignore[arg-type]
        lambda: Retention(keep_best=2),  # type: ignore[arg-type]
        lambda: Retention(trash_grace_s=-1.0),
        lambda: Retention(trash_grace_s=float("inf")),
        lambda: Retention(trash_grace_s="1h"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_policy_is_a_config_error(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        make()


def test_retention_composes_every_policy_it_names() -> None:
    retention = Retention(keep_last=1, keep_every=5, keep_best=(1, "l", "min"), keep_within_s=150)
    records = _scored({s: 1.0 / s if s != 3 else 0.0 for s in range(1, 11)})
    # keep_every: 5, 10; keep_best: 3 (loss 0); keep_within: 9, 10; newest two: 9, 10.
    assert _steps(decide(records, retention.policy()).keep) == [3, 5, 9, 10]
