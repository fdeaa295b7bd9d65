"""The checkpoint worker process (``executor="process"``): saves off the training process.

- :mod:`.parent`: :class:`~dcp_safe.worker.parent.SaveWorker`, the training process's side (it
  starts, feeds, watches and replaces the worker);
- :mod:`.boot`: the worker's first lines, before any import (its parent, its priority);
- :mod:`.main`: the worker's loop (save, commit, check, replicate);
- :mod:`.transport`: the staged state, errors and checks that cross between the two (the check
  a new checkpoint passes before it is trusted runs where the save ran).
"""
