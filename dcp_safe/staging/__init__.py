"""Budgeted host staging for DCP async saves: the memory envelope, the buffer pool, the stager.

``budget`` is pure byte arithmetic, ``pool`` owns the reusable host buffers, ``stager`` is the
``AsyncStager`` DCP calls. They are separate so the budget can be tested without torch or
threads and the pool without DCP.
"""

from __future__ import annotations

from dcp_safe.staging.budget import Admission, MemoryBudget
from dcp_safe.staging.capacity import (
    CapacityPlan,
    Generation,
    max_generations,
    node_budget,
    plan_capacity,
)
from dcp_safe.staging.options import StagerOptions, StagerStats, WhenBusy
from dcp_safe.staging.pool import BufferPool, PinMemory, PoolStats
from dcp_safe.staging.stager import BudgetedStager

__all__ = [
    "Admission",
    "BudgetedStager",
    "BufferPool",
    "CapacityPlan",
    "Generation",
    "MemoryBudget",
    "PinMemory",
    "PoolStats",
    "StagerOptions",
    "StagerStats",
    "WhenBusy",
    "max_generations",
    "node_budget",
    "plan_capacity",
]
