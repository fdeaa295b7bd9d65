"""The checkpoint worker's first lines: ``python -I boot.py PARENT FD [PATH ...]``.

Run by path with isolated imports (``-I``: no current directory, no ``PYTHON*`` variables, no
user site on ``sys.path``; a ``psutil.py`` planted where the job runs is never imported), before
``dcp_safe`` or torch is imported (seconds, and the window where a rank killed left a worker that
saved for it). Standard library only, in this order:

1. ``PR_SET_PDEATHSIG`` (Linux): the kernel SIGKILLs the worker when the thread that started it
   ends (:class:`~dcp_safe.worker.parent._Process` starts it from a thread that lives as long as
   the worker), also while it is stopped; then the parent pid from the command line is compared
   with ``os.getppid()``, after the signal is armed so that no death falls between: an orphan
   exits at once;
2. its priority lowered (nice, and idle-most best-effort I/O where psutil knows ionice);
3. a thread that beats (``("alive",)`` every :data:`BEAT_S`) and exits the worker once its
   parent is gone (where no ``PR_SET_PDEATHSIG`` is), from before the imports on: the parent
   kills a worker silent past its bound (a stopped or frozen worker, or one stuck without the
   GIL), whether it is starting or saving;
4. the parent's ``sys.path`` (its absolute entries, from the command line: a writer class of the
   caller's module unpickles here), then :func:`dcp_safe.worker.main.main`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9
_NICE = 10
BEAT_S = 1.0  # the parent's bound of silence is a multiple of it (worker.py)


def _beat(conn: Connection, lock: threading.Lock, parent: int) -> None:
    # A parent killed mid-save cannot say so: a save it will never hear of is not worth ending.
    while os.getppid() == parent:
        with contextlib.suppress(OSError), lock:
            conn.send(("alive",))
        time.sleep(BEAT_S)
    os._exit(3)


def boot(argv: list[str]) -> None:
    """Start the worker for parent ``argv[0]`` on the socket whose descriptor is ``argv[1]``."""
    parent, fd, paths = int(argv[0]), int(argv[1]), argv[2:]
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the beat thread watches
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _SIGKILL)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(3)
    sys.path[:0] = [p for p in paths if os.path.isabs(p) and p not in sys.path]
    with contextlib.suppress(OSError):
        os.nice(_NICE)
    try:  # psutil knows ionice where the platform has it (imported from the parent's path)
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    conn, lock = Connection(fd), threading.Lock()
    threading.Thread(
        target=_beat, args=(conn, lock, parent), name="dcp_safe-beat", daemon=True
    ).start()
    from dcp_safe.worker.main import main

    main(conn, lock, parent)
    # Everything the parent waits for has been sent: unloading torch at interpreter shutdown
    # only makes close() wait seconds longer (and tears gloo down where it can abort).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    boot(sys.argv[1:])
