"""The demo's summary says what it measured: the headline's ratio in words that fit it."""

from __future__ import annotations

import pytest

from dcp_safe.demo.report import DemoReport, SaveRecord, summary_lines


def _headline(sync_s: list[float], stall_s: list[float]) -> str:
    report = DemoReport(root="/r", remote="s3://b/r", remote_note="")
    for step, (sync, stall) in enumerate(zip(sync_s, stall_s, strict=True), 1):
        report.saves.append(SaveRecord(step, f"s{step}", sync, async_stall_s=stall))
    [line] = [line for line in summary_lines(report) if line.startswith("training stall")]
    return line


@pytest.mark.parametrize(
    ("sync_s", "stall_s", "words"),
    [
        ([0.070, 0.070, 0.070], [0.153, 0.153, 0.153], "153 ms async vs 70 ms for a synchronous"
         " save (2.2x more)"),  # the issue's: it read "(0.5x less)"
        ([0.300, 0.300, 0.300], [0.030, 0.030, 0.030], "30 ms async vs 300 ms for a synchronous"
         " save (10.0x less)"),
        ([0.050], [0.050], "50 ms async vs 50 ms for a synchronous save (the same)"),
    ],
)  # fmt: skip
def test_the_headline_ratio_says_more_or_less_as_it_is(
    sync_s: list[float], stall_s: list[float], words: str
) -> None:
    assert words in _headline(sync_s, stall_s)
