"""Fencing: a writer from an older job attempt can never publish once a newer attempt started.

The records, when they are checked, the window left and why a record is trusted by its name
alone: docs/architecture.md, "Fencing". ``_ATTEMPTS`` is opened beneath the root without
following a link, so registering never creates a file outside it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.choices import require_int
from dcp_safe.errors import ConfigError, StaleWriterError

ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
DEFAULT_RUN_ID = "default"


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One job attempt: its number (monotone across restarts) and the run it belongs to."""

    number: int
    run_id: str = DEFAULT_RUN_ID

    def __post_init__(self) -> None:
        require_int("attempt", self.number, 0, maximum=10**9 - 1)
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigError(f"run_id must be a non-empty str, got {self.run_id!r}")

    @property
    def directory(self) -> str:
        return layout.attempts_dir(self.run_id)

    @property
    def marker(self) -> str:
        return f"{self.directory}/{layout.attempt_record_name(self.number)}"


def attempt_from_env(
    number: int | None = None, environ: Mapping[str, str] | None = None
) -> Attempt | None:
    """The attempt a writer runs as: ``number`` if given, else torchelastic's restart count;
    None when neither is set (the writer is then not fenced)."""
    environ = os.environ if environ is None else environ
    run_id = environ.get(RUN_ID_ENV) or DEFAULT_RUN_ID
    if number is not None:
        return Attempt(number=number, run_id=run_id)
    raw = environ.get(ATTEMPT_ENV)
    if not raw:
        return None
    try:
        return Attempt(number=int(raw), run_id=run_id)
    except ValueError as exc:
        raise ConfigError(f"{ATTEMPT_ENV}={raw!r} is not an attempt number") from exc


def register_attempt(backend: Backend, attempt: Attempt) -> None:
    """Record that ``attempt`` saves under this root (idempotent; rank 0, at plan time)."""
    if backend.exists(attempt.marker):
        return
    backend.makedirs(attempt.directory)
    body = str(attempt.number).encode()
    # Another save of the same attempt may register it first: that is the same record.
    with contextlib.suppress(FileExistsError):
        backend.write_bytes(attempt.marker, body, exclusive=backend.supports_exclusive_create)


def check_fence(backend: Backend, attempt: Attempt | None) -> None:
    """StaleWriterError if a newer attempt than ``attempt`` has saved under this root."""
    if attempt is None:
        return
    # A record is a file named as Attempt.marker names one; anything else there (a folder or a
    # link under such a name) is no record, and is passed by.
    numbers = [layout.attempt_of_record(entry) for entry in backend.sizes(attempt.directory)]
    newest = max((n for n in numbers if n is not None), default=-1)
    if newest > attempt.number:
        record = backend.full_path(Attempt(number=newest, run_id=attempt.run_id).marker)
        # The explanation goes into ``failures``: that is what survives DCP's trip to every
        # rank (dcp_safe.errors.from_checkpoint_exception rebuilds the message from it), named
        # as rank 0's: the fence is checked where a save claims and publishes.
        raise StaleWriterError(
            "a writer of an older job attempt may not publish",
            {
                0: f"attempt {attempt.number} of run {attempt.run_id!r} is stale: attempt "
                f"{newest} has started saving under {backend.url} (its record: {record}); "
                "this process is a leftover of a restart, stop it. If no attempt "
                f"{newest} of this run exists (a record another job with this run id left, or "
                "one planted), remove that file, or set TORCHELASTIC_RUN_ID to a new run id"
            },
        )
