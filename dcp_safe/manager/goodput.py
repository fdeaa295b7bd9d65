"""The goodput controller (Young–Daly) and the expected-work-lost arithmetic.

Pure functions over values every rank agreed on (no clock, no torch, no threads): what
`SavePolicy(auto=True)` uses to choose the save interval, and what `stats()` reports as the
expected work lost per hour for every cadence. (Work in progress: issue #47 part 2.)
"""

from __future__ import annotations
