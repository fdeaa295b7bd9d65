"""A fault-injecting fsspec file system: wrap any other, and make it slow, failing or lying.

:class:`FaultyFileSystem` delegates every call to the file system it wraps (a local disk, moto or
real S3, memory...) and, per operation, applies a :class:`FaultPlan`: a delay, an exception on
the N-th operation (or from the N-th on, or with a probability), a torn write (a prefix is
stored, then the error), a flipped byte, a bounded hang before the error, as ``EIO``,
``ENOSPC``, a timeout or a dropped connection.

Why a file system and not a mock of dcp_safe's backends: the faults then reach the code under
test through exactly the path real storage faults take (fsspec call -> backend -> writer ->
commit), including the backend's own error mapping and clean-up, and the same drill runs on a
local root and on S3.

Why the state lives in a :class:`FaultInjector` and not in the file system: dcp_safe opens a
root more than once (the writer, the reader, ``verify_checkpoint``, the manager's threads), and
fsspec caches file system instances per thread; one injector shared through the storage options
keeps one operation count and one seeded random sequence for all of them, so "fail operation 7"
means the seventh operation of the whole job, deterministically when the job is single-threaded.

Operation kinds (what ``FaultPlan.ops`` names and what ``counts`` counts):

=========  =====================================================================================
``open``   ``open`` (either mode); S3 ``create_multipart_upload``
``write``  each ``write`` into a file opened for writing; S3 ``upload_part``
``close``  closing a written file (where a staged upload is completed); S3
           ``complete_multipart_upload``
``read``   each ``read`` from a file opened for reading; ``cat_file``; S3 ``get_object``
``pipe``   ``pipe_file`` (a small whole-file write, exclusive ones too); S3 ``put_object``
``info``   ``info``, ``exists``, ``isdir``, ``isfile``, ``size``; S3 ``head_object``
``list``   ``ls``, ``find``, listing multipart uploads
``mkdir``  ``makedirs``, ``mkdir``
``move``   ``mv``
``remove`` ``rm``, ``rm_file``; S3 ``abort_multipart_upload``, ``delete_object(s)``
``copy``   ``cp_file``, ``copy``; S3 ``copy_object``
``other``  any other S3 call
=========  =====================================================================================

Usage, by URL (``faulty://`` followed by the wrapped file system's own path)::

    faults = FaultInjector(FaultPlan(fail_at=3, ops=("write",)))
    writer = SafeStorageWriter("faulty:///nvme/run7",
                               storage_options={"target_protocol": "file", "faults": faults})

or around a file system instance: ``storage_options={"fs": s3fs_instance, "faults": faults}``.
"""

from __future__ import annotations

import contextlib
import errno
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from dcp_safe.backends.retry import single_try_s3_options
from dcp_safe.errors import ConfigError
from dcp_safe.testing.fault_plan import (
    OPERATION_KINDS,
    FaultError,
    FaultPlan,
    InjectedFault,
    _InjectedConnectionReset,
    _InjectedOSError,
    _InjectedTimeout,
)

__all__ = [
    "FAULTY_PROTOCOL",
    "OPERATION_KINDS",
    "FaultError",
    "FaultInjector",
    "FaultPlan",
    "FaultyFileSystem",
    "InjectedFault",
]

FAULTY_PROTOCOL = "faulty"
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_DATA_KINDS = frozenset({"write", "pipe", "read"})
_S3_KINDS = {
    "create_multipart_upload": "open",
    "upload_part": "write",
    "complete_multipart_upload": "close",
    "get_object": "read",
    "put_object": "pipe",
    "head_object": "info",
    "list_objects_v2": "list",
    "list_multipart_uploads": "list",
    "abort_multipart_upload": "remove",
    "delete_object": "remove",
    "delete_objects": "remove",
    "copy_object": "copy",
}


@dataclass(frozen=True)
class _Decision:
    """What to do to one operation."""

    delay_s: float = 0.0
    fail: bool = False
    flip: int | None = None  # a random 32-bit draw: which byte, and the xor mask


@dataclass
class _Record:
    """One injected failure, for messages and reports."""

    number: int
    kind: str
    path: str


@dataclass(eq=False)
class FaultInjector:
    """The live state of a plan: counters, the seeded random sequence, what was injected.

    Thread-safe; shared by every :class:`FaultyFileSystem` opened with it. ``counts`` counts
    every operation seen by kind, ``selected`` the operations the plan applies to, ``injected``
    the faults by type (``delay``, ``fail``, ``torn``, ``flip``, ``hang``), ``failures`` the
    failed operations in order.
    """

    plan: FaultPlan = field(default_factory=FaultPlan)
    counts: Counter[str] = field(default_factory=Counter, init=False)
    injected: Counter[str] = field(default_factory=Counter, init=False)
    failures: list[_Record] = field(default_factory=list, init=False)
    selected: int = field(default=0, init=False)
    enabled: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, FaultPlan):
            raise ConfigError(f"plan must be a FaultPlan, got {type(self.plan).__name__}")
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._rng = random.Random(self.plan.seed)

    def __repr__(self) -> str:  # fsspec tokenizes options by repr: keep each injector distinct
        return f"FaultInjector(id={id(self):#x}, plan={self.plan!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock")
        state.pop("_released")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._released = threading.Event()

    @property
    def calls(self) -> int:
        """Every operation seen, of any kind."""
        with self._lock:
            return sum(self.counts.values())

    def reset(self, plan: FaultPlan | None = None) -> None:
        """Zero the counters and restart the random sequence, with ``plan`` if given."""
        with self._lock:
            if plan is not None:
                self.plan = plan
            self.counts.clear()
            self.injected.clear()
            self.failures.clear()
            self.selected = 0
            self._rng = random.Random(self.plan.seed)

    def pause(self) -> None:
        """Stop injecting (operations are still counted), e.g. to check the results."""
        self.enabled = False

    def resume(self) -> None:
        """Inject again after :meth:`pause`."""
        self.enabled = True

    def release(self) -> None:
        """End every delay now, in progress or to come, and stop injecting: a test that left
        work stuck in a delay lets it finish before the test ends, not at interpreter exit."""
        self.enabled = False
        self._released.set()

    def _decide(self, kind: str, path: str) -> _Decision:
        plan = self.plan
        with self._lock:
            self.counts[kind] += 1
            if not self.enabled or not plan.selects(kind):
                return _Decision()
            self.selected += 1
            n = self.selected
            fail = plan.fail_at is not None and (
                n == plan.fail_at or (plan.persistent and n > plan.fail_at)
            )
            # Draw the same numbers for every selected operation, so that one plan's random
            # choices do not shift when another field changes what is injected.
            fail_draw, flip_draw, flip_value = (self._rng.random() for _ in range(3))
            fail = fail or fail_draw < plan.fail_probability
            flip = None
            if kind in _DATA_KINDS and not fail and flip_draw < plan.flip_probability:
                flip = int(flip_value * 2**32)
                self.injected["flip"] += 1
            if plan.delay_s:
                self.injected["delay"] += 1
            if fail:
                self.injected["fail"] += 1
                self.injected["hang"] += plan.hang_s > 0
                self.failures.append(_Record(n, kind, path))
            return _Decision(delay_s=plan.delay_s, fail=fail, flip=flip)

    def before(self, kind: str, path: str) -> _Decision:
        """Count an operation; sleep and raise as the plan says. Returns the decision, for
        the data operations (torn writes, flips)."""
        decision = self._decide(kind, path)
        if decision.delay_s:
            self._released.wait(decision.delay_s)
        return decision

    def raise_for(self, kind: str, path: str) -> None:
        """Raise the plan's error for a failing operation, after its hang."""
        plan = self.plan
        if plan.hang_s:
            time.sleep(plan.hang_s)
        n = self.failures[-1].number if self.failures else 0
        what = f"injected fault: {kind} #{n} of {path}"
        if plan.error is FaultError.TIMEOUT:
            raise _InjectedTimeout(errno.ETIMEDOUT, what)
        if plan.error is FaultError.CONNECTION:
            raise _InjectedConnectionReset(errno.ECONNRESET, what)
        code = errno.ENOSPC if plan.error is FaultError.ENOSPC else errno.EIO
        raise _InjectedOSError(code, what)

    def check(self, kind: str, path: str) -> _Decision:
        """:meth:`before`, raising at once for a failing operation that carries no data."""
        decision = self.before(kind, path)
        if decision.fail and (kind not in ("write", "pipe") or not self.plan.torn):
            self.raise_for(kind, path)
        return decision


def _flipped(data: Any, draw: int | None) -> Any:
    """``data`` (bytes-like) with one byte xor-ed, chosen by ``draw``; unchanged if empty."""
    if draw is None:
        return data
    view = memoryview(data).cast("B")
    if not view.nbytes:
        return data
    out = bytearray(view)
    out[draw % len(out)] ^= 1 + (draw >> 16) % 255
    return bytes(out)


class _FaultyFile:
    """A file of the wrapped file system, with its reads, writes and close passed through the
    injector."""

    def __init__(self, inner: Any, faults: FaultInjector, path: str, mode: str) -> None:
        self._inner = inner
        self._faults = faults
        self._path = path
        self._writable = "r" not in mode

    def write(self, data: Any) -> int:
        decision = self._faults.check("write", self._path)
        if decision.fail:  # torn: half the data lands, then the error
            view = memoryview(data).cast("B")
            self._inner.write(view[: view.nbytes // 2])
            self._faults.raise_for("write", self._path)
        return int(self._inner.write(_flipped(data, decision.flip)))

    def read(self, size: int = -1) -> bytes:
        decision = self._faults.check("read", self._path)
        data: bytes = self._inner.read(size)
        return bytes(_flipped(data, decision.flip))

    def readinto(self, buffer: Any) -> int:
        data = self.read(memoryview(buffer).nbytes)
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._writable and not self._inner.closed:
            try:
                self._faults.check("close", self._path)
            except BaseException:
                _drop(self._inner)  # the close failed: nothing may be published
                raise
        self._inner.close()

    def discard(self) -> None:
        _drop(self._inner)

    @property
    def closed(self) -> bool:
        return bool(self._inner.closed)

    @closed.setter
    def closed(self, value: bool) -> None:
        self._inner.closed = value

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _drop(f: Any) -> None:
    """Abandon a written file of the wrapped file system without publishing it."""
    discard = getattr(f, "discard", None)
    if callable(discard):
        # fsspec's local files refuse to discard in autocommit mode: closing is all there is.
        with contextlib.suppress(RuntimeError, OSError):
            discard()
    try:
        f.closed = True
    except AttributeError:  # a local file: closing it is all there is (the caller removes it)
        f.close()


class FaultyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Any fsspec file system, with faults injected per operation by a :class:`FaultInjector`.

    Args:
        fs: the file system to wrap (an instance); or else
        target_protocol: the protocol of the file system to build and wrap (default ``file``),
        target_options: and its options.
        faults: the injector (shared state); or else
        plan: a plan for a new injector of this file system's own.

    Paths are the wrapped file system's own (``/abs/path`` for ``file``, ``bucket/key`` for
    ``s3``). Capability checks should look at :attr:`fs`: this wrapper claims nothing itself.
    """

    protocol = FAULTY_PROTOCOL
    cachable = False  # state is in the injector; a cached instance would outlive its test
    root_marker = ""

    def __init__(
        self,
        fs: AbstractFileSystem | None = None,
        *,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        faults: FaultInjector | None = None,
        plan: FaultPlan | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if fs is not None and target_protocol is not None:
            raise ConfigError("give either fs (an instance) or target_protocol, not both")
        if faults is not None and plan is not None:
            raise ConfigError("give either faults (a shared injector) or plan, not both")
        if fs is None and target_protocol in ("s3", "s3a"):
            # As open_backend builds an S3 root: single-try clients (the retry layer above owns
            # retries and the deadline) and no listing cache (a stale one hides new shards).
            target_options = single_try_s3_options(target_options)
            target_options.setdefault("use_listings_cache", False)
        if fs is None:
            fs = fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        elif not isinstance(fs, AbstractFileSystem):
            raise ConfigError(f"fs must be an fsspec file system, got {type(fs).__name__}")
        self.fs: AbstractFileSystem = fs
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self._atomic_puts = bool(protocols & _OBJECT_STORES)
        self.faults = faults if faults is not None else FaultInjector(plan or FaultPlan())

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        prefix = f"{FAULTY_PROTOCOL}://"
        if path.startswith(prefix):
            path = path[len(prefix) :]
        return path.rstrip("/") or "/"

    def unstrip_protocol(self, name: str) -> str:
        return f"{FAULTY_PROTOCOL}://{name}"

    # ----------------------------------------------------------------- state

    @property
    def counts(self) -> Counter[str]:
        """Operations seen, by kind."""
        return self.faults.counts

    def reset(self, plan: FaultPlan | None = None) -> None:
        """See :meth:`FaultInjector.reset`."""
        self.faults.reset(plan)

    # ----------------------------------------------------------------- files

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        self.faults.check("open", path)
        return _FaultyFile(self.fs.open(path, mode, **kwargs), self.faults, path, mode)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        path = self._strip_protocol(path)
        decision = self.faults.check("read", path)
        return _flipped(self.fs.cat_file(path, start=start, end=end, **kw), decision.flip)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        decision = self.faults.check("pipe", path)
        if decision.fail and self._atomic_puts:  # a PUT lands whole or not at all
            self.faults.raise_for("pipe", path)
        if decision.fail:  # torn: a prefix lands, then the error
            self.fs.pipe_file(path, bytes(value[: len(value) // 2]), mode=mode, **kwargs)
            self.faults.raise_for("pipe", path)
        self.fs.pipe_file(path, _flipped(value, decision.flip), mode=mode, **kwargs)

    # ----------------------------------------------------------------- metadata

    def _call(self, kind: str, method: str, path: Any, *args: Any, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        self.faults.check(kind, " ".join(path) if isinstance(path, list) else str(path))
        return getattr(self.fs, method)(path, *args, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self._call("info", "info", path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self._call("info", "exists", path, **kwargs))

    def isdir(self, path: str) -> bool:
        return bool(self._call("info", "isdir", path))

    def isfile(self, path: str) -> bool:
        return bool(self._call("info", "isfile", path))

    def size(self, path: str) -> Any:
        return self._call("info", "size", path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._call("list", "ls", path, detail=detail, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._call("list", "find", path, *args, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._call("mkdir", "makedirs", path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._call("mkdir", "mkdir", path, create_parents=create_parents, **kwargs)

    def mv(self, path1: str, path2: str, *args: Any, **kwargs: Any) -> None:
        self._call("move", "mv", path1, self._strip_protocol(path2), *args, **kwargs)

    def rm(self, path: Any, recursive: bool = False, *args: Any, **kwargs: Any) -> None:
        self._call("remove", "rm", path, recursive, *args, **kwargs)

    def rm_file(self, path: str) -> None:
        self._call("remove", "rm_file", path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._call("copy", "cp_file", path1, self._strip_protocol(path2), **kwargs)

    def copy(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> None:
        self._call("copy", "copy", path1, self._strip_protocol(path2), *args, **kwargs)

    def created(self, path: str) -> Any:
        return self._call("info", "created", path)

    def modified(self, path: str) -> Any:
        return self._call("info", "modified", path)

    @property
    def target_fs(self) -> AbstractFileSystem:
        """The innermost file system under fault wrappers: capability checks look at this."""
        fs = self.fs
        while isinstance(fs, FaultyFileSystem):
            fs = fs.fs
        return fs

    # ----------------------------------------------------------------- S3 pass-through

    def __getattr__(self, name: str) -> Any:
        # Only where the wrapped file system has them, so that ``hasattr`` keeps telling the
        # truth about what the storage underneath can do.
        if name in _PASS_THROUGH and "fs" in self.__dict__ and hasattr(self.fs, name):
            return getattr(self, f"_faulty_{name}")
        raise AttributeError(name)

    def _faulty_call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """s3fs's ``call_s3`` through the injector (dcp_safe's multipart upload path)."""
        key = f"{kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}"
        self.faults.check(_S3_KINDS.get(method, "other"), key)
        return self.fs.call_s3(method, *args, **kwargs)

    def _faulty_split_path(self, path: str) -> Any:
        return self.fs.split_path(path)

    def _faulty_list_multipart_uploads(self, bucket: str) -> Any:
        self.faults.check("list", bucket)
        return self.fs.list_multipart_uploads(bucket)


_PASS_THROUGH = frozenset({"call_s3", "split_path", "list_multipart_uploads"})


fsspec.register_implementation(
    FAULTY_PROTOCOL, "dcp_safe.testing.faulty_fs.FaultyFileSystem", clobber=False
)
