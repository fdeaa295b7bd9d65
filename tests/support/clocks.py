"""A clock a test sets: one per rank, with its own origin and rate (a skewed host clock)."""

from __future__ import annotations


class SkewedClock:
    """Monotonic seconds ``start + rate * t``, where the test advances ``t``; counts its reads
    (a rank that polled its clock, waiting on it, would show in ``reads``)."""

    def __init__(self, start: float = 0.0, rate: float = 1.0) -> None:
        self.start, self.rate, self.true_s, self.reads = start, rate, 0.0, 0

    def advance(self, seconds: float) -> None:
        self.true_s += seconds

    def __call__(self) -> float:
        self.reads += 1
        return self.start + self.rate * self.true_s
