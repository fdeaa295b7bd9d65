"""A manager's event history: ``<root>/_history.jsonl``, one JSON object a line, oldest first.

This module owns the file's name, its schema and how it is written; the manager decides what to
record. It is a top-level file under the root, so listing never mistakes it for a checkpoint.

Event schema (every line; keys sorted; absent optional fields are left out)::

    event      str    requested | skipped | committed | failed | pruned
                      | fallback | rearmed | preempted | restored | rolled_back
                      | lease_taken_over
    step       int    the training step (null for events about no particular save)
    name       str    the checkpoint name (null likewise)
    time       float  ``time.time()`` when recorded
    tier       str    optional: "local" or "remote" ("initial" for a warm start's restore)
    reason     str    optional: why (a skip, a failure, a fallback, the signal of a preemption;
                      on "lease_taken_over": whose lease it was, and why it could be taken)
    validated  bool   optional: on "committed": verification passed
    metrics    dict   optional: on "committed": the save's metrics, as its manifest holds them
    source     str    optional: on "restored" from a warm start or ``restore(source=)``: the
                      URL it came from (shortened)
    source_digest str optional: with ``source``, for Hugging Face weights: "sha256:<hex>" of
                      their index and each file's name, size and header (what pins every
                      tensor's name, dtype, shape and place; dcp_safe.reading.safetensors_import)

Local roots append; other roots rewrite, since object stores have no append (the history stays
small). A rewrite is read-modify-write, so only the manager owning the root may record, and a
takeover of a lease by its save (:mod:`dcp_safe.commit.lease`, which calls
:func:`record_takeover`); one lock per history file serialises a process's threads, and is
re-entrant because a preemption handler may record while its thread is inside
:meth:`History.append`. A save in the manager's worker process appends from that process: an
event the manager rewrites at the same moment on an object store can lose that one line.

Reading is bounded and strict, since anyone who can write the root can write this file: only
the newest :data:`~dcp_safe.manifest.limits.HISTORY_MAX_BYTES` are read, anything but a regular
file is refused, and a line that is not an event of the schema is skipped with a warning
(docs/integrity.md, "Hostile storage").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend, not_a_file
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.commit.lease import TAKEOVER_HOOKS
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.limits import (
    HISTORY_MAX_BYTES,
    parse_json,
    require_int,
    require_str,
    require_timestamp,
)
from dcp_safe.manifest.schema import check_metrics
from dcp_safe.untrusted import shown

log = logging.getLogger(__name__)

HISTORY_FILE = layout.HISTORY_FILE

EVENTS = frozenset(
    {"requested", "skipped", "committed", "failed", "pruned", "fallback", "rearmed", "preempted"}
    | {"restored", "rolled_back", "lease_taken_over"}
)
# One lock per history file in this process: the manager's appends and a save's takeover
# record rewrite the same object (``setdefault`` is atomic: two threads get the same lock).
_LOCKS: dict[str, threading.RLock] = {}


class History:
    """Append to and read a root's history file."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = _LOCKS.setdefault(backend.full_path(HISTORY_FILE), threading.RLock())

    def append(self, event: str, step: int | None, name: str | None, **given: Any) -> None:
        """Record one event; ``None`` fields are left out. ValueError: no event of the schema."""
        if event not in EVENTS:
            raise ValueError(f"unknown history event {event!r}")
        # A reason may quote storage (a lease's text in an error): escaped, so the event never
        # carries a control character to whoever reads the history.
        more = {k: shown(v) if isinstance(v, str) else v for k, v in given.items() if v is not None}
        line = {"event": event, "step": step, "name": name, "time": time.time(), **more}
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        with self._lock:
            self.backend.makedirs("")
            if not isinstance(self.backend, LocalBackend):
                raw = self._raw()
                fresh_line = not raw or raw.endswith(b"\n")
                self.backend.write_bytes(HISTORY_FILE, raw + (b"" if fresh_line else b"\n") + data)
                return
            # Opened beneath the root without following links, a regular file with no other
            # hard link (LocalBackend.open_append): never a FIFO, a device or a file outside it.
            with self.backend.open_append(HISTORY_FILE) as f:
                # A torn tail (power loss mid-append) has no newline: start a fresh line, so
                # the new event is not glued to it and lost with it.
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        data = b"\n" + data
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # an acknowledged event survives power loss

    def read(self) -> list[dict[str, Any]]:
        """Every readable event, oldest first. A damaged line (a torn or NUL-filled tail after
        power loss) is skipped with a warning: it never hides the others or stops a manager."""
        with self._lock:
            try:
                raw = self._raw()
            except CheckpointCorruptError as exc:
                log.warning("%s is unreadable, read as empty: %s", HISTORY_FILE, shown(exc))
                return []
        events: list[dict[str, Any]] = []
        for number, line in enumerate(raw.split(b"\n"), 1):
            try:
                if line.strip():
                    events.append(_event(parse_json(line, self.backend.full_path(HISTORY_FILE))))
            except (CheckpointCorruptError, ValueError) as exc:
                log.warning("%s line %d skipped (torn?): %s", HISTORY_FILE, number, shown(exc))
        return events

    def validated_names(self) -> set[str]:
        """Names recorded as committed locally and validated."""
        local = [e for e in self.read() if e["event"] == "committed" and e.get("tier") == "local"]
        return {e["name"] for e in local if e.get("validated")}

    def _raw(self) -> bytes:
        """The file's newest :data:`HISTORY_MAX_BYTES`, from a line start on (b"": none yet);
        CheckpointCorruptError if it is not a regular file."""
        try:
            found = self.backend.stat(HISTORY_FILE)
            if found.kind != "file":
                raise not_a_file(self.backend.full_path(HISTORY_FILE), found.kind)
            if found.size_bytes <= HISTORY_MAX_BYTES:
                return self.backend.read_small(HISTORY_FILE, HISTORY_MAX_BYTES)
            with self.backend.open_read(HISTORY_FILE) as f:
                f.seek(found.size_bytes - HISTORY_MAX_BYTES)
                tail = f.read(HISTORY_MAX_BYTES)
        except FileNotFoundError:
            return b""
        log.warning(
            "%s is over %d bytes: only its newest events are read", HISTORY_FILE, HISTORY_MAX_BYTES
        )
        return tail[tail.find(b"\n") + 1 :]  # the first line is cut: drop it


_OPTIONAL = dict.fromkeys(("tier", "reason", "source", "source_digest"), str) | {
    "validated": bool,
    "metrics": dict,
}


def _event(raw: object) -> dict[str, Any]:
    """``raw`` if it is an event of the schema, field by field; else ValueError."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if raw.get("event") not in EVENTS:
        raise ValueError(f"unknown event {str(raw.get('event'))[:40]!r}")
    if "step" not in raw or "name" not in raw:
        raise ValueError("no 'step' or no 'name'")
    if raw["step"] is not None:
        require_int("step", raw["step"])
    if raw["name"] is not None:
        require_str("name", raw["name"], max_length=255)
    require_timestamp("time", raw.get("time"))
    for key, kind in _OPTIONAL.items():
        if key in raw and not isinstance(raw[key], kind):
            raise ValueError(f"{key} must be a {kind.__name__}")
    if "metrics" in raw:
        check_metrics(raw["metrics"])
    return raw


def record_takeover(backend: Backend, name: str, what: str) -> None:
    """Record that a save took ``name``'s lease over: ``what`` says whose, and why."""
    History(backend).append("lease_taken_over", None, name, reason=what)


TAKEOVER_HOOKS.append(record_takeover)
