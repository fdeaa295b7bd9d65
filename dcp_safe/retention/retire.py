"""Delete a committed checkpoint so that a crash half-way never leaves a broken one listed.

It is unpublished first, in one step, then deleted: on a renaming root renamed to a hidden
partial name (nothing lists it; the sweeper collects it after a kill), on an object store its
marker removed first (a kill leaves an unmarked prefix, never read as a checkpoint).
"""

from __future__ import annotations

from dcp_safe.backends.backend import Backend
from dcp_safe.commit.strategy import strategy_for

__all__ = ["retire_checkpoint"]


def retire_checkpoint(backend: Backend, name: str) -> None:
    """Unpublish checkpoint ``name``, then delete what it held."""
    strategy_for(backend).retire(backend, name)
