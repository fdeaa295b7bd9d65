"""The whole dcp_safe exception tree.

Every error dcp_safe raises on purpose derives from :class:`DcpSafeError`, and where a builtin
means the same thing the error inherits it too, so ``except FileNotFoundError`` keeps working::

    DcpSafeError(Exception)
    ├── ConfigError(ValueError)                  a bad argument or option value
    │   └── InvalidCheckpointNameError           a name with '/', '..', a leading dot, or empty
    ├── CheckpointExistsError(FileExistsError)   saving to a committed name without overwrite
    ├── CheckpointNotFoundError(FileNotFoundError)
    ├── CheckpointCorruptError(ValueError)       checksum, size or manifest mismatch
    │   ├── UnsafeCheckpointError                a pickle that would run code, a decoding bomb
    │   └── SignatureError                       not signed with the reader's key
    │       └── UnsignedCheckpointError          not signed at all
    ├── CommitError                              the save could not be published; per-rank failures
    │   ├── StaleWriterError                     a writer from an older attempt tried to publish
    │   ├── WorkerDiedError                      the process executor's worker died mid-save
    │   ├── WorkerError                          the worker failed with an error it could not send
    │   └── UploadTimeoutError(ReplicationTimeoutError)  ranks whose upload never arrived
    ├── StorageError(OSError)                    an I/O failure, naming the operation and path
    ├── BudgetExceededError                      a state larger than the host-memory envelope
    ├── SnapshotMutatedError                     the state changed in place while it was staged
    ├── DivergentStateError(ValueError)          ranks saved different values under one key
    ├── PerRankStateError(ValueError)            per-rank state saved by another world size
    ├── MissingKeysError(LookupError)            keys asked for are not in the checkpoint
    ├── RestoreMismatchError(ValueError)         an audited restore differs from what was saved
    ├── RollbackUnavailableError(LookupError)    no kept in-memory copy of the last commit
    ├── AdmissionTimeoutError(TimeoutError)      no admission within the caller's timeout
    ├── ReplicationSkippedError                  a pending replication superseded by a newer one
    ├── ReplicationTimeoutError(TimeoutError)    replication did not finish within a timeout
    ├── PeerCopyError                            a committed checkpoint's peer copies failed
    ├── DrainTimeoutError(TimeoutError)          a manager's wait/close gave up on work in flight
    └── LoadError                                a load failed on some ranks; per-rank failures

Paths, names and what was found (``expected``/``actual``) can be storage's text: the errors that
carry them escape them (:func:`~dcp_safe.untrusted.shown`), so a message is safe to log or
print; the attributes keep the text as it was.

DCP reports failures as ``CheckpointException``, which derives from ``BaseException`` (so
``except Exception`` misses it). :func:`from_checkpoint_exception` maps it to this tree once,
where it crosses dcp_safe's API (``dcp_safe.save`` / ``load``, and plain DCP's calls inside
``dcp_safe.translate_errors()``), keeping the original as ``__cause__``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dcp_safe.untrusted import shown

__all__ = [
    "AdmissionTimeoutError",
    "BudgetExceededError",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "ReplicationSkippedError",
    "ReplicationTimeoutError",
    "DcpSafeError",
    "SignatureError",
    "SnapshotMutatedError",
    "DivergentStateError",
    "DrainTimeoutError",
    "InvalidCheckpointNameError",
    "LoadError",
    "MissingKeysError",
    "PeerCopyError",
    "PerRankStateError",
    "PickledClassesError",
    "RestoreMismatchError",
    "RollbackUnavailableError",
    "StaleWriterError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsignedCheckpointError",
    "UploadTimeoutError",
    "WorkerDiedError",
    "WorkerError",
    "from_checkpoint_exception",
]


class DcpSafeError(Exception):
    """Root of every error dcp_safe raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # DCP moves a rank's error to its peers by pickling it, and the default reduce calls
        # cls(*args), which our keyword-rich constructors cannot take. Rebuild from the state.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[DcpSafeError], args: tuple[Any, ...], state: dict[str, Any]) -> DcpSafeError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(DcpSafeError, ValueError):
    """An argument or option has a value dcp_safe cannot work with."""


class InvalidCheckpointNameError(ConfigError):
    """A checkpoint name that could escape its root or hide itself (``name``)."""

    def __init__(self, name: object, reason: str) -> None:
        super().__init__(
            f"invalid checkpoint name {name!r}: {reason}; use a plain key such as 'step_000100'"
        )
        self.name = name


class CheckpointExistsError(DcpSafeError, FileExistsError):
    """The name is taken: committed (and ``overwrite`` is off), or held by another save."""

    def __init__(self, path: str, detail: str | None = None) -> None:
        super().__init__(
            f"the checkpoint name at {shown(path)} is taken: {shown(detail)}"
            if detail
            else f"a committed checkpoint already exists at {shown(path)}; pick a new name or"
            " write with options=WriterOptions(overwrite=True) (the old checkpoint then stays"
            " loadable until the new one commits)"
        )
        self.path = path


class CheckpointNotFoundError(DcpSafeError, FileNotFoundError):
    """No committed checkpoint under that name (or none at all for ``"latest"``)."""

    def __init__(self, path: str, detail: str = "") -> None:
        message = f"no committed checkpoint at {shown(path)}"
        super().__init__(f"{message}: {shown(detail)}" if detail else message)
        self.path = path


class CheckpointCorruptError(DcpSafeError, ValueError):
    """Stored bytes (``path``; ``item``, its fully qualified name and offset, where one is
    involved) do not match what the manifest promised (``expected``; ``actual`` was found)."""

    def __init__(
        self,
        path: str,
        reason: str,
        *,
        item: str | None = None,
        expected: object = None,
        actual: object = None,
    ) -> None:
        where = f"{shown(path)} (item {shown(item)})" if item else shown(path)
        detail = (
            f"; expected {shown(expected, 200)}, found {shown(actual, 200)}"
            if expected is not None
            else ""
        )
        super().__init__(f"corrupt checkpoint data in {where}: {shown(reason)}{detail}")
        self.path, self.item, self.expected, self.actual = path, item, expected, actual


class UnsafeCheckpointError(CheckpointCorruptError):
    """A pickle that refers to more than plain data, or an item that decodes to more than the
    checkpoint declares (a decompression or allocation bomb); see docs/integrity.md."""

    def __init__(
        self,
        path: str,
        reason: str,
        *,
        item: str | None = None,
        because: str = "loading it could run code from storage",
    ) -> None:
        super().__init__(
            path,
            f"{reason}; refused, because {because}. If you trust this root as you trust code,"
            " pass allow_pickle=True",
            item=item,
        )


class PickledClassesError(UnsafeCheckpointError):
    """A checkpoint whose metadata or objects can be rebuilt only by importing and running
    classes (``classes``, as ``module.name``): refused unless ``allow_pickle=True``."""

    def __init__(self, path: str, classes: list[str] | tuple[str, ...]) -> None:
        self.classes = tuple(classes)
        super().__init__(path, f"it needs pickled classes: {_listed([c[:120] for c in classes])}")


class SignatureError(CheckpointCorruptError):
    """A reader holding a signing key found a checkpoint its key did not sign."""

    _refused = (
        "it was not signed with this reader's key. Check that writer and reader use the same"
        " key (signing_key= or DCP_SAFE_SIGNING_KEY), or load a checkpoint the key signed"
    )

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, f"{reason}; refused, because {self._refused}")


class UnsignedCheckpointError(SignatureError):
    """A reader holding a signing key found a checkpoint with no signature at all."""

    _refused = (
        "this reader holds a signing key and accepts only checkpoints it signed. Save with"
        " WriterOptions(signing_key=) (or DCP_SAFE_SIGNING_KEY) to sign, or read without a key"
        " if you trust whoever can write the root"
    )

    def __init__(self, path: str, reason: str = "the checkpoint has no signature") -> None:
        super().__init__(path, reason)


class CommitError(DcpSafeError):
    """A save failed on one or more ranks, so nothing was published; ``failures``: each failing
    rank with a one-line description of its error."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures: dict[int, str] = dict(failures or {})
        if self.failures:
            message = f"{message} ({_per_rank(self.failures, ', ')})"
        super().__init__(message)


class StaleWriterError(CommitError):
    """A writer from an older job attempt tried to publish beside a newer attempt's work."""


class WorkerDiedError(CommitError):
    """The manager's checkpoint worker process (``executor="process"``) died during a save.

    The save counts as failed. A death before the commit publishes nothing (the commit rule);
    one between the commit and the worker's reply leaves a whole checkpoint the manager did not
    count. The previous checkpoint is untouched, and the next save starts a new worker.
    """


class WorkerError(CommitError):
    """The checkpoint worker failed with an error that could not be sent back as it was (its
    class name ``type_name``, its ``worker_traceback`` as text)."""

    def __init__(self, type_name: str, message: str, worker_traceback: str = "") -> None:
        super().__init__(f"the checkpoint worker failed with {type_name}: {message}")
        self.type_name, self.worker_traceback = type_name, worker_traceback


class StorageError(DcpSafeError, OSError):
    """An I/O ``operation`` ("write", "rename", "fsync", ...) failed on ``path``."""

    def __init__(self, operation: str, path: str, cause: BaseException | str) -> None:
        super().__init__(f"{operation} failed for {shown(path)}: {shown(cause)}")
        self.operation, self.path = operation, path


class BudgetExceededError(DcpSafeError):
    """A save needs more host memory than the whole envelope allows."""


class SnapshotMutatedError(DcpSafeError):
    """Source tensors changed in place (or were resized or freed) while a save staged them;
    nothing was published (``fqns``: the changed tensors; ``rank``: whose, ``None`` in a single
    process). See docs/staging.md, "A snapshot of one moment"."""

    def __init__(self, fqns: list[str] | tuple[str, ...], *, rank: int | None = None) -> None:
        self.fqns: tuple[str, ...] = tuple(fqns)
        self.rank = rank
        where = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"the state changed while it was being staged{where}: {_listed(self.fqns, 8)} changed"
            " in place (or were resized or freed) between the save request and the end of the"
            " copy, so the copy could be torn; nothing was published. Wait for staging to finish"
            " (handle.staged or resp.staging_completion) before updating the state in place, or"
            " use CheckpointManager's default staging='snapshot'"
        )


class DivergentStateError(DcpSafeError, ValueError):
    """Ranks saved different values under one key, which DCP would keep only one copy of.

    Raised on every rank, at planning, before anything is written. ``keys``: each differing key
    (as DCP flattens it) -> the ranks grouped by equal value."""

    def __init__(self, keys: Mapping[str, list[list[int]]]) -> None:
        self.keys = {k: [list(g) for g in groups] for k, groups in keys.items()}
        listed = _listed(
            [f"{k!r} ({' | '.join(_ranks(g) for g in groups)})" for k, groups in self.keys.items()],
            sep="; ",
        )
        prefixes = sorted({k.split(".")[0] for k in self.keys})
        # Thousands of top-level keys would make the advice unreadable: name a few.
        suggested = repr(tuple(prefixes)) if len(prefixes) <= 10 else "(...)"
        named = "" if len(prefixes) <= 10 else f" naming the {len(prefixes)} prefixes"
        super().__init__(
            f"ranks hold different values under the same key: {listed}. DCP would save"
            " one rank's value and restore it on every rank, so nothing was saved. Declare"
            " per-rank state: CheckpointManager(...,"
            f" resume=Resume(per_rank={suggested})){named} (or"
            " dcp_safe.save(..., per_rank=...)), or make the values equal on every rank"
        )


class PerRankStateError(DcpSafeError, ValueError):
    """Per-rank entry ``key`` (saved by ``saved_ranks``) restores only onto the world size that
    saved it, not this job's ``world_size``."""

    def __init__(self, key: str, *, saved_ranks: list[int], world_size: int) -> None:
        self.key, self.saved_ranks, self.world_size = key, list(saved_ranks), world_size
        super().__init__(
            f"{key!r} was saved per rank by {len(saved_ranks)} ranks and this job has"
            f" {world_size}: each rank restores its own value only on the world size that"
            " saved it, and no rank is handed another's. Restore without it"
            f" (exclude=[{key!r}]) and initialize it afresh"
        )


class MissingKeysError(DcpSafeError, LookupError):
    """Keys asked for (``keys``, as DCP flattens them) are not in the checkpoint (pass
    ``allow_partial=True`` to leave them)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)
        super().__init__(
            f"the checkpoint holds no {_listed([repr(k) for k in self.keys])}; restore with"
            " allow_partial=True to leave them as they are, or exclude them"
        )


class RollbackUnavailableError(DcpSafeError, LookupError):
    """``CheckpointManager.rollback`` has no kept copy of the last committed step on every rank
    (``keep_in_memory=True`` keeps one per verified asynchronous commit); restore from storage."""


class RestoreMismatchError(DcpSafeError, ValueError):
    """After a load, the live state differs from the fingerprints recorded when it was saved
    (``mismatches``: key, block and the ranks holding it, for each differing block)."""

    def __init__(self, checkpoint: str, mismatches: list[tuple[str, int, list[int]]]) -> None:
        self.checkpoint = checkpoint
        self.mismatches = [(k, int(b), list(r)) for k, b, r in mismatches]
        shown = _listed(
            [f"{k!r} block {b} on {_ranks(r)}" for k, b, r in self.mismatches], 10, "; "
        )
        super().__init__(
            f"the state restored from {checkpoint!r} is not what was saved: {shown}."
            " The load planner or the reader placed data wrongly; do not train on this state"
        )


def _ranks(group: list[int]) -> str:
    return ("rank " if len(group) == 1 else "ranks ") + ", ".join(map(str, group))


def _listed(texts: Sequence[str], limit: int = 20, sep: str = ", ") -> str:
    """The first ``limit`` of ``texts``, and how many more there are (a message stays short)."""
    more = f" and {len(texts) - limit} more" if len(texts) > limit else ""
    return sep.join(texts[:limit]) + more


def _per_rank(failures: Mapping[int, str], sep: str) -> str:
    return sep.join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))


class AdmissionTimeoutError(DcpSafeError, TimeoutError):
    """A save waited longer than its timeout for admission."""


class ReplicationSkippedError(DcpSafeError):
    """Pending replication ``name`` was dropped: newer checkpoint ``superseded_by`` replaced it
    in the queue."""

    def __init__(self, name: str, superseded_by: str) -> None:
        super().__init__(
            f"replication of {name!r} was skipped: {superseded_by!r} was submitted before it "
            "started, and only the newest pending checkpoint is replicated"
        )
        self.name, self.superseded_by = name, superseded_by


class ReplicationTimeoutError(DcpSafeError, TimeoutError):
    """``wait`` or ``close`` gave up before the replications in flight finished."""


class UploadTimeoutError(CommitError, ReplicationTimeoutError):
    """Rank 0 gave up waiting for some ranks' uploads; ``failures`` names the stalled ranks."""


class PeerCopyError(DcpSafeError):
    """Copying a committed checkpoint's node caches to other nodes (the peer tier) failed.

    Checkpoint ``name`` itself is committed on the remote and unaffected; a restore reads what
    a missing peer copy would have held from the remote instead. ``failures``: as CommitError's.
    """

    def __init__(self, name: str, failures: Mapping[int, str]) -> None:
        self.name = name
        self.failures: dict[int, str] = dict(failures)
        super().__init__(
            f"peer copies of {shown(name)} are incomplete ({_per_rank(failures, '; ')}); the"
            " checkpoint is committed on the remote, and a restore reads the missing copies' files"
            " from there. Check the named ranks' node-local disks and network"
        )


class DrainTimeoutError(DcpSafeError, TimeoutError):
    """A manager's ``wait`` or ``close`` gave up before its saves in flight were done."""


class LoadError(DcpSafeError):
    """A load failed on one or more ranks (DCP's planner or reader raised), the cause first.

    The ``checkpoint`` itself is untouched; the target state may be partly loaded.
    ``failures``: as CommitError's.
    """

    def __init__(self, checkpoint: str, failures: Mapping[int, str]) -> None:
        self.checkpoint = checkpoint
        self.failures: dict[int, str] = dict(failures)
        failed = _per_rank({rank: shown(why) for rank, why in self.failures.items()}, "; ")
        super().__init__(
            f"load of {shown(checkpoint)} failed on {failed}. The checkpoint is intact; the target"
            " state may be partly loaded: fix the cause and load again"
        )


def describe(exc: BaseException) -> str:
    """``Type: message``: how one rank's error reads in a ``failures`` map or a marker."""
    return f"{type(exc).__name__}: {exc}"


def portable(error: BaseException, fallback: BaseException) -> bytes:
    """``error`` pickled for another process of this job (a peer rank, the checkpoint worker's
    parent); ``fallback`` pickled instead where ``error`` does not survive pickling."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(fallback)


def restored(data: bytes, fallback: Callable[[Exception], BaseException]) -> BaseException:
    """The error :func:`portable` pickled (by a process of this job: never data from storage);
    ``fallback(exc)``, with what went wrong, where it cannot be rebuilt here."""
    try:
        error = pickle.loads(data)
        if not isinstance(error, BaseException):
            raise TypeError(f"not an error: {error!r}")
    except Exception as exc:
        return fallback(exc)
    return error


def from_checkpoint_exception(exc: BaseException) -> BaseException:
    """Map DCP's ``CheckpointException`` onto this tree.

    When every failing rank raised the same dcp_safe error type, the first such error is
    returned as it is (it carries the most context: path, item, checksums). Otherwise the
    result is a :class:`CommitError` whose ``failures`` name each rank. Anything that is not a
    ``CheckpointException`` is returned unchanged.
    """
    failures: Any = getattr(exc, "failures", None)
    if type(exc).__name__ != "CheckpointException" or not isinstance(failures, dict):
        return exc
    errors = {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in failures.items()}
    first = errors[min(errors)]
    kind: type[CommitError] = CommitError
    described = {rank: describe(e) for rank, e in errors.items()}
    if len({type(e) for e in errors.values()}) == 1 and isinstance(first, DcpSafeError):
        if not isinstance(first, CommitError):
            first.__cause__ = exc
            return first
        kind = type(first)
        described = dict(first.failures) or {min(errors): describe(first)}
    error = kind("save was not published", described)
    error.__cause__ = exc
    return error
