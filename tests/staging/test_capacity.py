"""Capacity planning: envelope, one generation, N overlapping generations, with own numbers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_safe.errors import ConfigError
from dcp_safe.staging.capacity import (
    GIB,
    Generation,
    max_generations,
    node_budget,
    plan_capacity,
)


def test_worked_example_one_generation_fits_two_do_not() -> None:
    node = node_budget(
        usable_bytes=512 * GIB,
        training_peak_bytes=250 * GIB,
        other_consumers_bytes=70 * GIB,
        reserve_bytes=64 * GIB,
    )
    generation = Generation(staged_bytes=92 * GIB, buffer_bytes=24 * GIB)
    one = plan_capacity(node, generation)
    assert one.envelope_bytes == 128 * GIB
    assert one.generation_bytes == 116 * GIB
    assert one.fits and one.headroom_bytes == 12 * GIB
    two = plan_capacity(node, generation, generations=2)
    assert two.needed_bytes == 232 * GIB
    assert not two.fits and two.headroom_bytes == -104 * GIB
    assert one.max_generations == two.max_generations == 1


def test_explain_states_figures_and_verdict() -> None:
    node = node_budget(
        usable_bytes=512 * GIB,
        training_peak_bytes=250 * GIB,
        other_consumers_bytes=70 * GIB,
        reserve_bytes=64 * GIB,
    )
    two = plan_capacity(
        node, Generation(staged_bytes=92 * GIB, buffer_bytes=24 * GIB), generations=2
    )
    line = two.explain()
    assert "232.00 GiB" in line and "128.00 GiB" in line and "do NOT fit" in line
    assert "at most 1 in flight" in line


def test_node_budget_is_the_stagers_envelope() -> None:
    node = node_budget(
        usable_bytes=64 * GIB,
        training_peak_bytes=40 * GIB,
        other_consumers_bytes=2 * GIB,
        reserve_bytes=4 * GIB,
    )
    assert node.envelope_bytes == 18 * GIB
    assert "planned" in node.explain()


def test_node_over_committed_fits_nothing() -> None:
    node = node_budget(
        usable_bytes=64 * GIB,
        training_peak_bytes=60 * GIB,
        other_consumers_bytes=8 * GIB,
        reserve_bytes=4 * GIB,
    )
    plan = plan_capacity(node, Generation(staged_bytes=1))
    assert plan.envelope_bytes == 0 and not plan.fits and plan.max_generations == 0


def test_empty_generation_fits_and_counts_no_generations() -> None:
    node = node_budget(
        usable_bytes=8 * GIB, training_peak_bytes=0, other_consumers_bytes=0, reserve_bytes=0
    )
    plan = plan_capacity(node, Generation(staged_bytes=0), generations=3)
    assert plan.fits and plan.needed_bytes == 0 and plan.max_generations == 0


@pytest.mark.parametrize("generations", [0, -1, 1.5, True])
def test_generations_must_be_a_positive_int(generations: object) -> None:
    node = node_budget(
        usable_bytes=8 * GIB, training_peak_bytes=0, other_consumers_bytes=0, reserve_bytes=0
    )
    with pytest.raises(ConfigError, match="generations"):
        plan_capacity(node, Generation(staged_bytes=1), generations=generations)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["staged_bytes", "buffer_bytes"])
@pytest.mark.parametrize("value", [-1, 1.0, None])
def test_generation_sizes_must_be_non_negative_ints(field: str, value: object) -> None:
    sizes: dict[str, object] = {"staged_bytes": 1, "buffer_bytes": 1, field: value}
    with pytest.raises(ConfigError, match=field):
        Generation(**sizes)  # type: ignore[arg-type]


@given(
    envelope=st.integers(min_value=0, max_value=1 << 50),
    staged=st.integers(min_value=0, max_value=1 << 45),
    buffers=st.integers(min_value=0, max_value=1 << 40),
    generations=st.integers(min_value=1, max_value=16),
)
def test_fits_exactly_when_n_times_working_set_is_within_envelope(
    envelope: int, staged: int, buffers: int, generations: int
) -> None:
    node = node_budget(
        usable_bytes=envelope + 1, training_peak_bytes=1, other_consumers_bytes=0, reserve_bytes=0
    )
    generation = Generation(staged_bytes=staged, buffer_bytes=buffers)
    plan = plan_capacity(node, generation, generations=generations)
    assert plan.envelope_bytes == envelope
    assert plan.fits == (generations * (staged + buffers) <= envelope)
    top = max_generations(node, generation)
    if staged + buffers:
        assert plan_capacity(node, generation, generations=max(top, 1)).fits == (top >= 1)
        assert not plan_capacity(node, generation, generations=top + 1).fits
