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
import threading
import time
from typing import Any

from dcp_safe.backends.backend import Backend
from dcp_safe.backends.local_backend import LocalBackend

__all__ = ["EVENTS", "HISTORY_FILE", "History"]

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
                with open(self.backend.full_path(HISTORY_FILE), "ab") as f:
                    f.write(data)
            else:
                self.backend.write_bytes(HISTORY_FILE, self._raw() + data)

    def read(self) -> list[dict[str, Any]]:
        """Every event, oldest first."""
        with self._lock:
            raw = self._raw()
        return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]

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
