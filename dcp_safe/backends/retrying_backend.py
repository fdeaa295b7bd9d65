"""A backend wrapper that retries transient failures of every small operation.

A wrapper, so any backend gains retries and the backends stay one-try; the clients underneath
must try once too (:func:`single_try_s3_options`). See docs/architecture.md, "Transient faults
and deadlines".

An exclusive create whose reply was lost comes back as ``FileExistsError``, refused by our own
object; aiohttp resends an idempotent ``PUT`` once on a dropped connection, so this happens even
on what looks like the first attempt. So every such refusal is checked by reading the object
back: the same bytes mean our write succeeded. This relies on the payloads of exclusive creates
being unique to their writer, as dcp_safe's are (a lease names its save id; a marker holds the
digest of a manifest that names it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, BinaryIO, TypeVar

from dcp_safe.backends.backend import Backend, WritableFile
from dcp_safe.backends.retry import RetryPolicy, call_with_retries

__all__ = ["RetryingBackend", "single_try_s3_options"]

T = TypeVar("T")


def _retried(op: str, method: str) -> Any:
    """The method ``method`` of :class:`RetryingBackend`: its inner backend's, retried whole as
    the operation ``op`` on the path it is given first."""

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
        """The inner backend's flag; where it probes the server, the probe is retried."""
        return self._retry("probe", "", lambda: self.inner.supports_exclusive_create)

    @supports_exclusive_create.setter
    def supports_exclusive_create(self, value: bool) -> None:
        self.inner.supports_exclusive_create = value

    def __repr__(self) -> str:
        return f"RetryingBackend({self.inner!r}, {self.policy!r})"

    def full_path(self, rel: str) -> str:
        return self.inner.full_path(rel)

    def _retry(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        return call_with_retries(op, self.full_path(rel), fn, self.policy)

    # ----------------------------------------------------------------- writing

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        return self.inner.open_write(rel)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        once = self._create_exclusive if exclusive else self.inner.write_bytes
        self._retry("write", rel, lambda: once(rel, data))

    def _create_exclusive(self, rel: str, data: bytes) -> None:
        """One try at an exclusive create; a refusal by our own earlier write is success."""
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

    # ----------------------------------------------------------------- reading

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

    def entries_holding(self, member: str) -> list[str]:
        return self._retry("list", "", lambda: self.inner.entries_holding(member))

    # ----------------------------------------------------------------- layout

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
    """s3fs ``storage_options`` under which botocore tries each request once, with bounded
    timeouts, so that :class:`RetryingBackend` owns retries and its deadline holds.

    Settings the caller already made in ``config_kwargs`` win. s3fs's own retry loop (the class
    attribute ``S3FileSystem.retries``, five tries) is not reachable through storage options;
    set ``fs.retries = 1`` on the file system as well.

    Args:
        storage_options: the user's options (not modified).
        connect_timeout_s: botocore's connect timeout for one try.
        read_timeout_s: botocore's read timeout for one try (between bytes, not in total).
            Long, because some servers (moto; AWS less so, it sends keep-alive whitespace)
            answer CompleteMultipartUpload of a large object only when done: at 15 s a 1 GiB
            upload to moto timed out. The deadline bounds when new attempts start; one attempt
            that hangs is bounded by this timeout.

    Returns:
        A new options dict.
    """
    options = copy.deepcopy(dict(storage_options or {}))
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
    config.setdefault("connect_timeout", connect_timeout_s)
    config.setdefault("read_timeout", read_timeout_s)
    options["config_kwargs"] = config
    return options
