"""Retrying transient storage failures: the policy, the classifier and the loop.

:func:`is_transient` tells accidents (``500``, ``503 SlowDown``, a dropped connection, a
timeout) from answers (``403``, ``404``, ``412``); :func:`call_with_retries` retries accidents
under a :class:`RetryPolicy`; :class:`RetryingBackend` retries every small operation of a
one-try backend. The clients underneath try once (:func:`single_try_s3_options`), because s3fs's
and botocore's own loops multiply when stacked and ignore our deadline (docs/architecture.md,
"Transient faults and deadlines").

What reaches us from s3fs 2026.9: HTTP error replies are botocore ``ClientError`` s, which s3fs
turns into builtin errors with the ``ClientError`` as ``__cause__`` (``NoSuchKey`` ->
``FileNotFoundError``, ``SlowDown`` -> ``OSError(EBUSY)``, ``InternalError`` ->
``OSError(EREMOTEIO)``, ``RequestTimeout`` -> ``TimeoutError``); transport failures are botocore
errors left as they are (``ReadTimeoutError``, ``ConnectionClosedError``,
``EndpointConnectionError``), raised while handling the aiohttp error (``__context__``); the
backend wraps ``OSError`` s in ``StorageError``. So the classifier walks the
``__cause__``/``__context__`` chain until an exception decides.

An exclusive create whose reply was lost comes back as ``FileExistsError``, refused by our own
object (aiohttp resends an idempotent ``PUT`` once on a dropped connection, so even a first
attempt can). Every such refusal is checked by reading the object back: the same bytes mean our
write succeeded. This relies on the payloads of exclusive creates being unique to their writer,
as dcp_safe's are (a lease names its save id; a marker holds the digest of a manifest).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import logging
import math
import random as _random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar

from dcp_safe.backends.backend import Backend
from dcp_safe.errors import ConfigError, DcpSafeError, StorageError
from dcp_safe.manifest.streams import WritableFile

T = TypeVar("T")

logger = logging.getLogger(__name__)

# S3 error codes (and the bare status codes botocore uses when a reply has no XML body) that
# mean "try again later".
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}
    | {str(status) for status in _TRANSIENT_STATUS}
)
# Answers, not accidents: asking again gets the same answer. Checked before anything else, so a
# FileNotFoundError caused by a 404 ClientError is never mistaken for the transport error below.
_FINAL_TYPES: tuple[type[OSError], ...] = (FileNotFoundError, FileExistsError, PermissionError)
_FINAL_TYPES += (IsADirectoryError, NotADirectoryError)
_MAX_CHAIN = 16  # how deep to follow __cause__/__context__ (chains are short; cycles are possible)


def _unit_random() -> float:
    # A module-level function, not ``random.random`` (a bound method of a hidden Random
    # instance), so that a policy pickles by reference into DCP's process-based executor.
    return _random.random()


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long and how often to retry a transient storage failure.

    The n-th retry (n = 0, 1, ...) waits ``uniform(0, min(max_delay_s, base_delay_s * 2**n))``
    ("full jitter", so that ranks hit by the same throttling spread out). No attempt starts and
    no sleep ends after ``deadline_s`` from the first attempt (all attempts and sleeps of one
    operation); an attempt already in flight is bounded by the client's own connect/read
    timeouts. ``attempts`` counts the first one (1: never retry). ``sleep``, ``clock`` and
    ``random`` are seams for tests; ``on_retry`` gets each backoff's seconds before it
    (``RetryPolicy(on_retry=telemetry.on_retry)``). A value out of range is a ConfigError.
    """

    deadline_s: float = 60.0
    attempts: int = 8
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    random: Callable[[], float] = field(default=_unit_random, repr=False, compare=False)
    on_retry: Callable[[float], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        d, a, lo, hi = self.deadline_s, self.attempts, self.base_delay_s, self.max_delay_s
        real = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (d, a, lo, hi))
        # NaN fails every comparison.
        if not (
            real and isinstance(a, int) and a >= 1 and 0 < d < math.inf and 0 <= lo <= hi < math.inf
        ):
            raise ConfigError(
                "a RetryPolicy needs an int attempts >= 1, 0 < deadline_s < inf and"
                f" 0 <= base_delay_s <= max_delay_s < inf, got {self!r}"
            )

    def backoff_s(self, retry: int) -> float:
        cap = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(retry, 64))
        return cap * self.random()


# Configuration problems surface from the S3 client stack as its own exception types
# (botocore's NoCredentialsError, an unreachable endpoint...), outside the OSError tree that
# s3fs maps HTTP answers into: they are mapped here, once, with what to check.
_CLIENT_MODULES = ("botocore", "aiobotocore", "aiohttp")
_CLIENT_HINT = "check the endpoint and credentials in storage_options or the AWS_* variables"


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same request may succeed.

    Transient: HTTP 500/502/503/504 and S3's ``SlowDown``, ``ServiceUnavailable``,
    ``InternalError``, ``RequestTimeout``; dropped or reset connections; connect and read
    timeouts — as botocore, aiohttp or builtin exceptions, or as an ``OSError`` (s3fs's, or a
    ``StorageError``) whose ``__cause__``/``__context__`` chain holds one. Not transient: every
    other HTTP answer (403 ``PermissionError``, 404 ``FileNotFoundError``, 412
    ``FileExistsError``), TLS errors, and dcp_safe's own errors other than ``StorageError``.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _MAX_CHAIN:
        seen.add(id(current))
        if (verdict := _classify(current)) is not None:
            return verdict
        current = current.__cause__ or current.__context__
    return False


def _classify(exc: BaseException) -> bool | None:
    # True or False when ``exc`` alone decides; None to look at what caused it.
    if isinstance(exc, _FINAL_TYPES):
        return False
    if isinstance(exc, DcpSafeError):
        return None if isinstance(exc, StorageError) else False
    if isinstance(response := getattr(exc, "response", None), dict):  # botocore ClientError
        code, status = reply_error(response)
        return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    transient, final = _library_types()
    return False if isinstance(exc, final) else True if isinstance(exc, transient) else None


def reply_error(response: object) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of a botocore reply (``("", None)`` where absent)."""
    if not isinstance(response, dict):
        return "", None
    error, metadata = response.get("Error"), response.get("ResponseMetadata")
    code = str(error.get("Code", "")) if isinstance(error, dict) else ""
    status = metadata.get("HTTPStatusCode") if isinstance(metadata, dict) else None
    return code, status if isinstance(status, int) else None


def s3_error(exc: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status behind an s3fs ``OSError``, whose ``__cause__`` is
    botocore's ``ClientError`` (``("", None)`` if none); a server may send either without the
    other, so a 416 is also reported as InvalidRange."""
    code, status = reply_error(getattr(exc.__cause__, "response", None))
    return ("InvalidRange", 416) if code == "InvalidRange" or status == 416 else (code, status)


@functools.cache
def _library_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    # (transient, final) types. s3fs, a dependency, brings both libraries (slow to import).
    import aiohttp
    from botocore import exceptions as boto

    transient: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    transient += [boto.HTTPClientError, boto.ConnectionError, boto.IncompleteReadError]
    transient += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    # boto's SSLError is a ConnectionError, but no retry will fix it.
    return tuple(transient), (boto.SSLError, aiohttp.ClientSSLError)


def call_with_retries(op_name: str, path: str, fn: Callable[[], T], policy: RetryPolicy) -> T:
    """Run ``fn`` (safe to run again after a transient failure), retrying transient failures.
    StorageError naming ``op_name`` and ``path`` when one outlasted the attempts or the deadline
    (the last is its ``__cause__``), or the S3 client stack refused to send the request at all
    (no credentials, a bad endpoint), with a hint; any other error from ``fn`` as it is."""
    start = policy.clock()
    for attempt in itertools.count(1):
        try:
            return fn()
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
            if not is_transient(exc):
                client = type(exc).__module__.startswith(_CLIENT_MODULES)
                if client and not isinstance(exc, OSError | DcpSafeError):
                    raise StorageError(op_name, path, f"{failure} ({_CLIENT_HINT})") from exc
                raise
            delay, now = policy.backoff_s(attempt - 1), policy.clock()
            if attempt >= policy.attempts or now + delay >= start + policy.deadline_s:
                gave_up = f"gave up after {attempt} attempt(s) in {now - start:.1f} s"
                why = f"{gave_up} (deadline {policy.deadline_s:g} s); last error: {failure}"
                raise StorageError(op_name, path, why) from exc
            retrying = "%s %s: attempt %d failed (%s); retrying in %.2f s"
            logger.info(retrying, op_name, path, attempt, failure, delay)
            if policy.on_retry is not None:
                policy.on_retry(delay)
            policy.sleep(delay)
    raise AssertionError("unreachable")


def _retried(op: str, method: str) -> Any:
    # ``method`` of the inner backend, retried whole as the operation ``op`` on its first path.

    def call(self: RetryingBackend, rel: str, *args: Any) -> Any:
        return self._retry(op, rel, lambda: getattr(self.inner, method)(rel, *args))

    return call


class RetryingBackend(Backend):
    """``inner`` with transient failures retried under ``policy``.

    ``inner``'s url and capability flags are copied. Every operation is retried as a whole
    (a listing too), and ``open_read`` only in its opening, except two passed through:
    ``open_write``, whose body is the caller's code (the writer retries a failed file whole,
    and a failed streamed write leaves nothing behind), and ``publish_dir``, a rename, which is
    not safe to repeat.
    """

    def __init__(self, inner: Backend, policy: RetryPolicy) -> None:
        self.inner = inner
        self.policy = policy
        self.url = inner.url
        self.supports_atomic_rename = inner.supports_atomic_rename
        self.process_local = inner.process_local

    @property
    def supports_exclusive_create(self) -> bool:
        # The inner backend's flag; where it probes the server, the probe is retried.
        return self._retry("probe", "", lambda: self.inner.supports_exclusive_create)

    @supports_exclusive_create.setter
    def supports_exclusive_create(self, value: bool) -> None:
        self.inner.supports_exclusive_create = value

    def __repr__(self) -> str:
        return f"RetryingBackend({self.inner!r}, {self.policy!r})"

    def _retry(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        return call_with_retries(op, self.full_path(rel), fn, self.policy)

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        return self.inner.open_write(rel)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        once = self._create_exclusive if exclusive else self.inner.write_bytes
        self._retry("write", rel, lambda: once(rel, data))

    def _create_exclusive(self, rel: str, data: bytes) -> None:
        # One try at an exclusive create; a refusal by our own earlier write is success.
        try:
            self.inner.write_bytes(rel, data, exclusive=True)
        except FileExistsError:
            try:
                stored = self.inner.read_bytes(rel)
            except FileNotFoundError:
                stored = None  # removed since: not ours to claim
            if stored != data:
                raise
            # A transient failure of this read propagates and the whole step is retried.

    @contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        def enter() -> tuple[ExitStack, BinaryIO]:
            with ExitStack() as stack:
                f = stack.enter_context(self.inner.open_read(rel))
                return stack.pop_all(), f

        stack, f = self._retry("open", rel, enter)
        with stack:
            yield f

    read_bytes = _retried("read", "read_bytes")
    read_small = _retried("read", "read_small")
    size = _retried("stat", "size")
    stat = _retried("stat", "stat")
    exists = _retried("stat", "exists")
    is_dir = _retried("stat", "is_dir")
    sizes = _retried("list", "sizes")
    list_dir = _retried("list", "list_dir")
    modified_at = _retried("list", "modified_at")

    def walk_files(self, rel: str) -> Iterator[str]:
        # A listing cannot resume halfway, so it is taken whole and retried whole.
        yield from self._retry("list", rel, lambda: list(self.inner.walk_files(rel)))

    def entries_holding(self, member: str, *, unless: str | None = None) -> list[str]:
        return self._retry("list", "", lambda: self.inner.entries_holding(member, unless=unless))

    makedirs = _retried("mkdir", "makedirs")
    remove_tree = _retried("remove", "remove_tree")
    remove_file = _retried("remove", "remove_file")
    remove_empty_dir = _retried("remove", "remove_empty_dir")
    sync_dir = _retried("fsync", "sync_dir")

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        return self.inner.publish_dir(src, dst, replace=replace)


def single_try_s3_options(
    storage_options: dict[str, Any] | None = None,
    *,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """A copy of ``storage_options`` under which botocore tries each request once, with
    bounded timeouts, so that :class:`RetryingBackend` owns retries and its deadline holds.

    Settings the caller already made in ``config_kwargs`` win. s3fs's own retry loop (the class
    attribute ``S3FileSystem.retries``) is not reachable through storage options; set
    ``fs.retries = 1`` on the file system as well. ``read_timeout_s`` (between bytes, for one
    try) is long because some servers (moto; AWS less so, it sends keep-alive whitespace)
    answer CompleteMultipartUpload of a large object only when done: at 15 s a 1 GiB upload to
    moto timed out. The deadline bounds when attempts start; this bounds one that hangs.
    """
    options = copy.deepcopy(dict(storage_options or {}))
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
    config.setdefault("connect_timeout", connect_timeout_s)
    config.setdefault("read_timeout", read_timeout_s)
    options["config_kwargs"] = config
    return options
