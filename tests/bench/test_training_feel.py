"""benchmarks/bench_training_feel.py: every contender saves for real and gets a row.

A tiny run and no timing asserted: it proves each contender's path (DCP's thread and process
executors, dcp_safe.async_save with a BudgetedStager, CheckpointManager) saves while the loop
steps and reports figures or a reason, so the figures in docs/benchmarks.md come from a working
measurement. The window and ratio arithmetic is checked on made-up timestamps.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import pytest
from support import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_training_feel.py"

bench = load_script(SCRIPT)

FIGURES = ("stall_s", "steady_mean_s", "bg_ratio", "bg_ratio_vs_pre", "window_s", "background_s")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("feel")
    tiny = "--quick --states 4x64KiB,50x4KiB --step-ms 2 --steady-steps 8 --pre-steps 2"
    args = bench.parse_args([*tiny.split(), "--tail-steps", "6"])
    return bench.run(args, work), work


def test_every_contender_has_a_row_with_positive_figures_or_a_reason(
    tiny_run: tuple[dict[str, Any], Path],
) -> None:
    results, _ = tiny_run
    assert [s["state"] for s in results["states"]] == ["4 x 64KiB", "50 x 4KiB"]
    for entry in results["states"]:
        assert list(entry["contenders"]) == bench.CONTENDERS
        for name, row in entry["contenders"].items():
            if row.get("reason"):
                continue  # cannot run on this host, and says why
            for key in FIGURES:
                assert math.isfinite(row[key]) and row[key] > 0, (entry["state"], name, key)
            assert math.isfinite(row["lost_s"])  # negative when the loop sped up
            assert row["window_steps"] >= 0 and row["window_s"] >= row["stall_s"]
            assert len(row["rounds"]) == 1


def test_the_run_records_load_and_leaves_no_checkpoint_behind(
    tiny_run: tuple[dict[str, Any], Path],
) -> None:
    results, work = tiny_run
    assert len(results["load_average_start"]) == 3 and len(results["load_average_end"]) == 3
    assert results["step_iterations"] > 0
    assert list(work.iterdir()) == []
    text = bench.report(results)
    assert text.count("| 50 x 4KiB |") == len(bench.CONTENDERS)
    assert "load average" in text


def _steps(start: float, durations: list[float]) -> list[tuple[float, float]]:
    spans = []
    for d in durations:
        spans.append((start, start + d))
        start += d
    return spans


def test_the_window_ends_with_the_last_run_of_slow_steps_and_ignores_a_lone_one() -> None:
    steady = _steps(0.0, [0.010] * 10)
    # save() from 1.000 to 1.050; the background ends at 1.110, after three 20 ms steps; then
    # steady steps with one lone slow step the median smoothing must not count.
    after = _steps(1.050, [0.020] * 3 + [0.010] * 5 + [0.030] + [0.010] * 5)
    row = bench.feel(steady, called=1.000, returned=1.050, ended=1.110, after=after)
    assert row["stall_s"] == pytest.approx(0.050)
    assert row["background_s"] == pytest.approx(0.110)
    assert row["steps_during_background"] == 3
    assert row["bg_ratio"] == pytest.approx(2.0)
    assert row["lost_s"] == pytest.approx(0.050 + 3 * 0.010)  # the stall, then 10 ms a step
    # Smoothed (5-step medians): steps 0..2 stay slow (20 ms), step 3 onwards is 10 ms.
    assert row["window_steps"] == 3
    assert row["window_s"] == pytest.approx(0.110)


def test_a_save_that_slows_nothing_has_a_window_of_its_stall() -> None:
    steady = _steps(0.0, [0.010] * 10)
    after = _steps(1.050, [0.010] * 10)
    row = bench.feel(steady, called=1.000, returned=1.050, ended=1.060, after=after)
    assert row["bg_ratio"] == pytest.approx(1.0)
    assert row["lost_s"] == pytest.approx(0.050)
    assert row["window_steps"] == 0 and row["window_s"] == pytest.approx(0.050)


def test_a_background_phase_over_before_the_first_step_has_no_ratio() -> None:
    steady = _steps(0.0, [0.010] * 10)
    row = bench.feel(steady, 1.000, 1.050, 1.040, _steps(1.050, [0.010] * 5))
    assert row["bg_ratio"] is None and row["steps_during_background"] == 0
    assert bench._summarise({"rounds": [row]})["reason"].startswith("the background phase ended")


@pytest.mark.parametrize(
    ("text", "count", "nbytes"),
    [("16x16MiB", 16, 16 << 20), ("10000x32KiB", 10_000, 32 << 10), ("2 x 8b", 2, 8)],
)
def test_states_are_written_count_x_size(text: str, count: int, nbytes: int) -> None:
    spec = bench.parse_state(text)
    assert (spec.count, spec.tensor_bytes) == (count, nbytes)


@pytest.mark.parametrize("text", ["16", "16x", "0x1MiB", "4x1TiB", "x1MiB"])
def test_a_malformed_state_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_state(text)


def test_quick_fills_in_only_what_the_command_line_left_alone() -> None:
    args = bench.parse_args(["--quick", "--rounds", "2"])
    assert args.rounds == 2 and args.steady_steps == bench.QUICK["steady_steps"]
    assert [s.count for s in args.states] == [16, 1000]
