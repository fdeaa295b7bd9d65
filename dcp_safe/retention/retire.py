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

from dcp_safe import layout
from dcp_safe.backends.backend import Backend

__all__ = ["retire_checkpoint"]


def retire_checkpoint(backend: Backend, name: str) -> None:
    """Unpublish checkpoint ``name``, then delete what it held."""
    if backend.supports_atomic_rename:
        parked = layout.partial_dir_name(name, layout.new_save_id())
        backend.publish_dir(name, parked, replace=False)
        backend.sync_dir("")
        backend.remove_tree(parked)
    else:
        backend.remove_file(f"{name}/{layout.COMMITTED_MARKER}")
        backend.remove_tree(name)
