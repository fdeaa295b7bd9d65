"""Delete a committed checkpoint so that a crash half-way never leaves a broken one listed.

Deleting file by file would leave, after a kill, a directory whose ``_COMMITTED`` marker still
promises files that are gone: listed, and corrupt. So the checkpoint is unpublished first, in
one step, and only then deleted:

* backends that rename atomically: the directory is renamed to a hidden partial name (which
  nothing lists, and which the sweeper collects if the process dies before the delete);
* object stores: the marker is removed first. What a kill leaves behind is then an unmarked
  prefix, never read as a checkpoint.
"""

from __future__ import annotations

from dcp_safe.backends.backend import Backend
from dcp_safe.commit.strategy import strategy_for

__all__ = ["retire_checkpoint"]


def retire_checkpoint(backend: Backend, name: str) -> None:
    """Unpublish checkpoint ``name``, then delete what it held."""
    strategy_for(backend).retire(backend, name)
