"""dcp_safe.bench.measure.RssSampler: the one RSS sampler of the benchmarks."""

from __future__ import annotations

import os
import time

from dcp_safe.bench.measure import RssSampler

_GROWTH = 64 << 20


def test_the_thread_sees_memory_allocated_and_freed_inside() -> None:
    with RssSampler(interval_s=0.001) as rss:
        block = bytearray(os.urandom(1024)) * (_GROWTH // 1024)  # touched: resident
        time.sleep(0.2)  # no sample is asked for here: the thread must take one
        del block
    assert rss.peak_delta_bytes >= _GROWTH // 2
    assert rss.peak_bytes == rss.baseline_bytes + rss.peak_delta_bytes


def test_take_peak_starts_a_new_window_at_rss_now() -> None:
    with RssSampler(interval_s=0.001) as rss:
        block = bytearray(os.urandom(1024)) * (_GROWTH // 1024)
        first = rss.take_peak()
        del block
        second = rss.take_peak()
    assert first >= rss.baseline_bytes + _GROWTH // 2
    assert second <= first
    assert rss.peak_bytes >= first


def test_stop_returns_the_peak_of_the_whole_run() -> None:
    rss = RssSampler().start()
    assert rss.stop() == rss.peak_bytes >= rss.baseline_bytes > 0
