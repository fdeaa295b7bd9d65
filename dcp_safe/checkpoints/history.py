"""A manager's event history: ``<root>/_history.jsonl``, one JSON object a line, oldest first.

This module owns the file's name, its schema and how it is written; the manager decides what to
record. It is a top-level file under the root, so listing never mistakes it for a checkpoint.

Event schema (every line; keys sorted; absent optional fields are left out)::

    event      str    requested | skipped | committed | failed | pruned
                      | fallback | rearmed | preempted
    step       int    the training step (null for events about no particular save)
    name       str    the checkpoint name (null likewise)
    time       float  ``time.time()`` when recorded
    tier       str    optional: "local" or "remote"
    reason     str    optional: why (a skip, a failure, a fallback, the signal of a preemption)
    validated  bool   optional: on "committed": verification passed

Why append on local roots and rewrite elsewhere: object stores have no append, and the history
stays small (a few events per save). A rewrite is read-modify-write, so only one writer (the
manager owning the root) may record at a time; the lock here serialises one manager's threads.
The lock is re-entrant because a preemption handler (see :mod:`dcp_safe.manager.preemption`)
may record on the main thread while that thread is inside :meth:`History.append`; each local
line is one ``write`` call, so lines stay whole.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from dcp_safe.backends.backend import Backend
from dcp_safe.backends.local_backend import LocalBackend

__all__ = ["EVENTS", "HISTORY_FILE", "History"]

log = logging.getLogger(__name__)

HISTORY_FILE = "_history.jsonl"

EVENTS = frozenset(
    {
        "requested",
        "skipped",
        "committed",
        "failed",
        "pruned",
        "fallback",
        "rearmed",
        "preempted",
    }
)


class History:
    """Append to and read a root's history file.

    Args:
        backend: the root's backend.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = threading.RLock()

    def append(self, event: str, step: int | None, name: str | None, **fields: Any) -> None:
        """Record one event; ``None`` fields are left out.

        Raises:
            ValueError: an event not in the schema.
        """
        if event not in EVENTS:
            raise ValueError(f"unknown history event {event!r}")
        line: dict[str, Any] = {"event": event, "step": step, "name": name}
        line |= {k: v for k, v in fields.items() if v is not None}
        line["time"] = time.time()
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        with self._lock:
            self.backend.makedirs("")
            if isinstance(self.backend, LocalBackend):
                self._append_local(data)
            else:
                raw = self._raw()
                fresh_line = not raw or raw.endswith(b"\n")
                self.backend.write_bytes(HISTORY_FILE, raw + (b"" if fresh_line else b"\n") + data)

    def _append_local(self, data: bytes) -> None:
        path = self.backend.full_path(HISTORY_FILE)
        with open(path, "a+b") as f:
            # A torn tail (power loss mid-append) has no newline: start a fresh line, so the
            # new event is not glued to it and lost with it.
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    data = b"\n" + data
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # an acknowledged event survives power loss

    def read(self) -> list[dict[str, Any]]:
        """Every readable event, oldest first.

        A line that is not a JSON object (a torn or NUL-filled tail after power loss, or any
        damaged line) is skipped with a warning: one bad line never hides the others or stops a
        manager from starting.
        """
        with self._lock:
            raw = self._raw()
        events: list[dict[str, Any]] = []
        for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict):
                log.warning(
                    "%s line %d is not an event (torn write?): skipped", HISTORY_FILE, number
                )
                continue
            events.append(event)
        return events

    def validated_names(self) -> set[str]:
        """Names recorded as committed locally and validated."""
        return {
            e["name"]
            for e in self.read()
            if e.get("event") == "committed" and e.get("tier") == "local" and e.get("validated")
        }

    def _raw(self) -> bytes:
        try:
            return self.backend.read_bytes(HISTORY_FILE)
        except FileNotFoundError:
            return b""
