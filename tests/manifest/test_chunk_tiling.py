"""``chunk_tiling_problem``: chunks tile a tensor exactly, or the reason they do not."""

from __future__ import annotations

import pytest

from dcp_safe.manifest.limits import TILE_MAX_CELLS
from dcp_safe.manifest.verify import chunk_tiling_problem


@pytest.mark.parametrize(
    ("shape", "chunks"),
    [
        ((9, 6), [((0, 0), (5, 6)), ((5, 0), (4, 6))]),  # rows, uneven
        ((6, 10), [((0, 0), (6, 5)), ((0, 5), (6, 5))]),  # columns
        ((4, 4), [((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]),  # a grid
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]),  # uneven grid
        ((), [((), ())]),  # 0-d
        ((0, 3), [((0, 0), (0, 3))]),  # empty
    ],
)
def test_exact_tilings_pass(
    shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], ...]]
) -> None:
    assert chunk_tiling_problem(shape, chunks) is None


def test_an_overlap_that_hides_a_gap_of_the_same_size_is_named() -> None:
    # 9 rows: rows 0-4 and 4-8, 54 elements as in an exact tiling; row 4 twice, row 8 never.
    problem = chunk_tiling_problem((9, 6), [((0, 0), (5, 6)), ((4, 0), (5, 6))])
    assert problem == "the chunks at [0, 0] and [4, 0] overlap"


def test_a_gap_is_named_by_its_first_element() -> None:
    problem = chunk_tiling_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2))])
    assert problem == "no chunk holds the element at [2, 2]"
    assert chunk_tiling_problem((), []) == "no chunk holds the element at []"


def test_a_chunk_outside_the_tensor_or_of_another_rank() -> None:
    assert "lies outside" in str(chunk_tiling_problem((4,), [((2,), (3,))]))
    assert "lies outside" in str(chunk_tiling_problem((4,), [((0, 0), (4, 1))]))


def test_a_huge_declared_tensor_costs_cells_not_elements() -> None:
    rows = [((i, 0), (1, 1 << 40)) for i in range(1000)]
    assert chunk_tiling_problem((1000, 1 << 40), rows) is None
    assert (
        chunk_tiling_problem((1 << 40, 1 << 40), rows) == "no chunk holds the element at [1000, 0]"
    )


def test_a_grid_past_the_bound_is_refused_unchecked() -> None:
    side = 1 << 12  # a diagonal of 4096 chunks cuts 4096 x 4096 = 2**24 cells
    diagonal = [((i, i), (1, 1)) for i in range(side)]
    assert side * side > TILE_MAX_CELLS
    assert "pieces to check" in str(chunk_tiling_problem((side, side), diagonal))
