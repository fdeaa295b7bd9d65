"""RetryingBackend: against a scripted in-memory backend, and against moto through FaultProxy."""

from __future__ import annotations

import errno
import io
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from botocore.exceptions import ConnectionClosedError

from dcp_safe.backends.backend import Backend, WritableFile
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.backends.retry import (
    RetryingBackend,
    RetryPolicy,
    is_transient,
    single_try_s3_options,
)
from dcp_safe.errors import StorageError
from dcp_safe.testing.backend_contract import BackendContract
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy

# A policy for the scripted backend: nothing really sleeps.
_NO_SLEEP = RetryPolicy(attempts=5, sleep=lambda s: None)


def _reset() -> BaseException:
    return ConnectionResetError(errno.ECONNRESET, "connection reset by peer")


class ScriptedBackend(Backend):
    """A dict of files; ``script[op]`` lists errors its next calls raise, in order.

    A ``("lost", exc)`` entry applies the call, then raises ``exc`` (a lost reply); a callable
    entry runs (another writer, say) and the call then proceeds.
    """

    def __init__(self) -> None:
        self.url = "scripted://root"
        self.supports_exclusive_create = True
        self.supports_atomic_rename = True
        self.files: dict[str, bytes] = {}
        self.script: dict[str, list[Any]] = {}
        self.calls: list[str] = []

    def _step(self, op: str) -> BaseException | None:
        """Raise the next scripted error for ``op``; return one to raise after applying."""
        self.calls.append(op)
        queue = self.script.get(op, [])
        if not queue:
            return None
        entry = queue.pop(0)
        if callable(entry):
            entry()
            return None
        if isinstance(entry, tuple):
            return entry[1]  # type: ignore[no-any-return]
        raise entry

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        self._step("open_write")
        return self._writer(rel)

    @contextmanager
    def _writer(self, rel: str) -> Iterator[WritableFile]:
        buf = io.BytesIO()
        yield buf
        self.files[rel] = buf.getvalue()

    @contextmanager
    def _reader(self, rel: str) -> Iterator[BinaryIO]:
        self._raise_after(self._step("open_read"))
        if rel not in self.files:
            raise FileNotFoundError(rel)
        yield io.BytesIO(self.files[rel])

    def open_read(self, rel: str) -> AbstractContextManager[BinaryIO]:
        return self._reader(rel)

    @staticmethod
    def _raise_after(after: BaseException | None) -> None:
        if after is not None:
            raise after

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        after = self._step("write_bytes")
        if exclusive and rel in self.files:
            raise FileExistsError(errno.EEXIST, "exists", rel)
        self.files[rel] = bytes(data)
        self._raise_after(after)

    def read_bytes(self, rel: str) -> bytes:
        self._raise_after(self._step("read_bytes"))
        if rel not in self.files:
            raise FileNotFoundError(rel)
        return self.files[rel]

    def size(self, rel: str) -> int:
        return len(self.read_bytes(rel))

    def exists(self, rel: str) -> bool:
        self._raise_after(self._step("exists"))
        return rel in self.files

    def list_dir(self, rel: str) -> list[str]:
        self._raise_after(self._step("list_dir"))
        prefix = f"{rel}/" if rel else ""
        return sorted({k[len(prefix) :].split("/")[0] for k in self.files if k.startswith(prefix)})

    def is_dir(self, rel: str) -> bool:
        self._raise_after(self._step("is_dir"))
        return any(k.startswith(f"{rel}/") for k in self.files)

    def makedirs(self, rel: str) -> None:
        self._raise_after(self._step("makedirs"))

    def remove_tree(self, rel: str) -> None:
        self._raise_after(self._step("remove_tree"))
        for k in [k for k in self.files if k == rel or k.startswith(f"{rel}/")]:
            del self.files[k]

    def publish_dir(self, src: str, dst: str, *, replace: bool) -> str | None:
        self._raise_after(self._step("publish_dir"))
        return None


@pytest.fixture
def inner() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture
def backend(inner: ScriptedBackend) -> RetryingBackend:
    return RetryingBackend(inner, _NO_SLEEP)


def test_copies_url_and_capabilities(inner: ScriptedBackend, backend: RetryingBackend) -> None:
    assert backend.url == inner.url
    assert backend.supports_exclusive_create and backend.supports_atomic_rename
    assert backend.full_path("a/b") == "scripted://root/a/b"


_SMALL_OPS: dict[str, tuple[str, Callable[[Backend], object], object]] = {
    # name: (the inner op that fails, the call, its result)
    "write_bytes": ("write_bytes", lambda b: b.write_bytes("d/new", b"x"), None),
    "read_bytes": ("read_bytes", lambda b: b.read_bytes("d/f"), b"data"),
    "size": ("read_bytes", lambda b: b.size("d/f"), 4),
    "exists": ("exists", lambda b: b.exists("d/f"), True),
    "list_dir": ("list_dir", lambda b: b.list_dir("d"), ["f"]),
    "sizes": ("list_dir", lambda b: b.sizes("d"), {"f": 4}),
    "walk_files": ("list_dir", lambda b: list(b.walk_files("d")), ["f"]),
    "is_dir": ("is_dir", lambda b: b.is_dir("d"), True),
    "makedirs": ("makedirs", lambda b: b.makedirs("d"), None),
    "remove_tree": ("remove_tree", lambda b: b.remove_tree("gone"), None),
    "remove_file": ("remove_tree", lambda b: b.remove_file("gone"), None),
}


@pytest.mark.parametrize("name", _SMALL_OPS)
def test_small_operations_survive_transient_failures(
    inner: ScriptedBackend, backend: RetryingBackend, name: str
) -> None:
    failing_op, call, expected = _SMALL_OPS[name]
    inner.files["d/f"] = b"data"
    inner.script[failing_op] = [_reset(), TimeoutError()]
    assert call(backend) == expected
    assert inner.script[failing_op] == []


def test_persistent_failure_names_operation_and_path(
    inner: ScriptedBackend, backend: RetryingBackend
) -> None:
    inner.script["read_bytes"] = [_reset() for _ in range(10)]
    with pytest.raises(StorageError) as info:
        backend.read_bytes("d/f")
    assert info.value.operation == "read"
    assert info.value.path == "scripted://root/d/f"
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert inner.calls.count("read_bytes") == 5


def test_not_found_is_not_retried(inner: ScriptedBackend, backend: RetryingBackend) -> None:
    with pytest.raises(FileNotFoundError):
        backend.read_bytes("missing")
    assert inner.calls == ["read_bytes"]


def test_open_read_retries_the_open(inner: ScriptedBackend, backend: RetryingBackend) -> None:
    inner.files["f"] = b"abc"
    inner.script["open_read"] = [_reset()]
    with backend.open_read("f") as f:
        assert f.read() == b"abc"
    assert inner.calls == ["open_read", "open_read"]
    with pytest.raises(FileNotFoundError), backend.open_read("missing"):
        pass


def test_open_write_passes_through(inner: ScriptedBackend, backend: RetryingBackend) -> None:
    inner.script["open_write"] = [_reset()]
    with pytest.raises(ConnectionResetError):
        backend.open_write("f")
    assert inner.calls == ["open_write"]  # not retried: the body is the caller's code
    with backend.open_write("f") as f:
        f.write(b"streamed")
    assert inner.files["f"] == b"streamed"


def test_publish_dir_passes_through(inner: ScriptedBackend, backend: RetryingBackend) -> None:
    inner.script["publish_dir"] = [_reset()]
    with pytest.raises(ConnectionResetError):
        backend.publish_dir("a", "b", replace=False)
    assert inner.calls == ["publish_dir"]


# ------------------------------------------------------------------ exclusive create


def test_lost_reply_on_exclusive_create_is_our_own_write(
    inner: ScriptedBackend, backend: RetryingBackend
) -> None:
    inner.script["write_bytes"] = [("lost", ConnectionClosedError(endpoint_url="http://x"))]
    backend.write_bytes("_COMMITTED", b"digest-ours", exclusive=True)
    assert inner.files["_COMMITTED"] == b"digest-ours"
    assert inner.calls == ["write_bytes", "write_bytes", "read_bytes"]


def test_exclusive_create_refused_by_other_bytes(
    inner: ScriptedBackend, backend: RetryingBackend
) -> None:
    inner.files["_COMMITTED"] = b"digest-theirs"
    with pytest.raises(FileExistsError):
        backend.write_bytes("_COMMITTED", b"digest-ours", exclusive=True)
    assert inner.files["_COMMITTED"] == b"digest-theirs"
    assert inner.calls == ["write_bytes", "read_bytes"]


def test_exclusive_create_refused_after_a_lost_reply_by_other_bytes(
    inner: ScriptedBackend, backend: RetryingBackend
) -> None:
    # The first try failed before applying; meanwhile another writer took the key.
    def other_writer_wins() -> None:
        inner.files["_COMMITTED"] = b"digest-theirs"

    inner.script["write_bytes"] = [_reset(), other_writer_wins]
    with pytest.raises(FileExistsError):
        backend.write_bytes("_COMMITTED", b"digest-ours", exclusive=True)
    assert inner.files["_COMMITTED"] == b"digest-theirs"
    assert inner.calls == ["write_bytes", "write_bytes", "read_bytes"]


def test_exclusive_create_read_back_is_retried(
    inner: ScriptedBackend, backend: RetryingBackend
) -> None:
    inner.script["write_bytes"] = [("lost", _reset())]
    inner.script["read_bytes"] = [TimeoutError()]
    backend.write_bytes("m", b"ours", exclusive=True)
    assert inner.calls == ["write_bytes", "write_bytes", "read_bytes", "write_bytes", "read_bytes"]


def test_exclusive_create_of_a_vanished_object_is_refused(
    inner: ScriptedBackend, backend: RetryingBackend
) -> None:
    inner.files["m"] = b"theirs"
    original = inner.read_bytes

    def read_after_delete(rel: str) -> bytes:
        inner.files.pop(rel, None)
        return original(rel)

    inner.read_bytes = read_after_delete  # type: ignore[method-assign]
    with pytest.raises(FileExistsError):
        backend.write_bytes("m", b"ours", exclusive=True)


# ------------------------------------------------------------------ the contract, wrapped


class TestRetryingLocalBackend(BackendContract):
    hides_open_writes = False

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        (tmp_path / "root").mkdir()
        return RetryingBackend(LocalBackend(str(tmp_path / "root"), fsync=False), RetryPolicy())


class TestRetryingMemoryBackend(BackendContract):
    def make_backend(self) -> Backend:
        inner = FsspecBackend(f"memory://retrying-{uuid.uuid4().hex}")
        return RetryingBackend(inner, RetryPolicy())


# ------------------------------------------------------------------ real S3 through the proxy

_TIMEOUT_S = 2.0


def _s3_backend(
    proxy: FaultProxy, bucket: str, policy: RetryPolicy, **extra: Any
) -> RetryingBackend:
    options = single_try_s3_options(
        proxy.storage_options(**extra), connect_timeout_s=_TIMEOUT_S, read_timeout_s=_TIMEOUT_S
    )
    inner = FsspecBackend(f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}", options)
    inner.fs.retries = 1  # s3fs's own loop; no storage option reaches it
    return RetryingBackend(inner, policy)


@pytest.fixture
def s3_backend(proxy: FaultProxy, s3_bucket: str) -> RetryingBackend:
    policy = RetryPolicy(deadline_s=20, attempts=6, base_delay_s=0.05, max_delay_s=0.5)
    return _s3_backend(proxy, s3_bucket, policy)


def _key(backend: RetryingBackend, rel: str) -> str:
    return backend.full_path(rel).removeprefix("s3://").split("/", 1)[1]


def _stored(s3: LocalS3, bucket: str, key: str) -> bytes:
    body: bytes = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


_ONE_OFF = [(500, "InternalError"), (503, "SlowDown")]


@pytest.mark.s3
class TestThroughFaultProxy:
    @pytest.mark.parametrize(("status", "code"), _ONE_OFF)
    def test_one_off_error_on_write_bytes(
        self,
        s3: LocalS3,
        s3_bucket: str,
        proxy: FaultProxy,
        s3_backend: RetryingBackend,
        status: int,
        code: str,
    ) -> None:
        fault = proxy.fail(status, code, method="PUT", key="/shard")
        s3_backend.write_bytes("shard", b"tensor bytes")
        assert fault.hits == 1
        assert len(proxy.requests("PUT", "/shard")) == 2  # the fault, then our retry
        assert _stored(s3, s3_bucket, _key(s3_backend, "shard")) == b"tensor bytes"

    @pytest.mark.parametrize(("status", "code"), _ONE_OFF)
    def test_one_off_error_on_read_bytes_and_size(
        self, proxy: FaultProxy, s3_backend: RetryingBackend, status: int, code: str
    ) -> None:
        s3_backend.write_bytes("shard", b"0123456789")
        get = proxy.fail(status, code, method="GET", key="/shard")
        assert s3_backend.read_bytes("shard") == b"0123456789"
        head = proxy.fail(status, code, method="HEAD", key="/shard")
        assert s3_backend.size("shard") == 10
        head_again = proxy.fail(status, code, method="HEAD", key="/shard")
        with s3_backend.open_read("shard") as f:
            assert f.read() == b"0123456789"
        assert (get.hits, head.hits, head_again.hits) == (1, 1, 1)

    def test_read_timeout_is_retried(self, proxy: FaultProxy, s3_backend: RetryingBackend) -> None:
        s3_backend.write_bytes("shard", b"slow")
        fault = proxy.delay(_TIMEOUT_S + 3, method="GET", key="/shard")
        assert s3_backend.read_bytes("shard") == b"slow"
        assert fault.hits == 1

    def test_persistent_503_fails_within_the_deadline(
        self,
        proxy: FaultProxy,
        s3_bucket: str,
    ) -> None:
        deadline_s = 3.0
        policy = RetryPolicy(deadline_s=deadline_s, attempts=1000, base_delay_s=0.05)
        backend = _s3_backend(proxy, s3_bucket, policy)
        fault = proxy.fail(503, "SlowDown", method="PUT", times=None)
        start = time.monotonic()
        with pytest.raises(StorageError) as info:
            backend.write_bytes("d/shard", b"never")
        elapsed = time.monotonic() - start
        assert elapsed < deadline_s + 10  # without a deadline this would run for minutes
        assert info.value.operation == "write"
        assert info.value.path == backend.full_path("d/shard")
        assert info.value.path.startswith(f"s3://{s3_bucket}/") and "d/shard" in str(info.value)
        assert is_transient(info.value.__cause__)  # type: ignore[arg-type]
        assert fault.hits >= 2

    @pytest.mark.parametrize("drops", [1, 2], ids=["resent-by-aiohttp", "retried-by-us"])
    def test_dropped_reply_on_exclusive_create_is_our_own_write(
        self,
        s3: LocalS3,
        s3_bucket: str,
        proxy: FaultProxy,
        s3_backend: RetryingBackend,
        drops: int,
    ) -> None:
        # One drop: aiohttp resends the PUT itself and the resend gets 412. Two drops: that
        # resend is lost too, ConnectionClosedError reaches the retry loop, and our retry gets
        # the 412. Either way the marker is ours and the create succeeds.
        fault = proxy.drop_reply(method="PUT", key="_COMMITTED", times=drops)
        s3_backend.write_bytes("_COMMITTED", b"digest-ours", exclusive=True)
        assert fault.hits == drops
        assert len(proxy.requests("PUT", "_COMMITTED")) == drops + 1
        assert _stored(s3, s3_bucket, _key(s3_backend, "_COMMITTED")) == b"digest-ours"

    def test_exclusive_create_of_a_taken_key_raises(
        self,
        s3: LocalS3,
        s3_bucket: str,
        s3_backend: RetryingBackend,
    ) -> None:
        s3_backend.write_bytes("_COMMITTED", b"digest-theirs", exclusive=True)
        with pytest.raises(FileExistsError):
            s3_backend.write_bytes("_COMMITTED", b"digest-ours", exclusive=True)
        assert _stored(s3, s3_bucket, _key(s3_backend, "_COMMITTED")) == b"digest-theirs"


@pytest.mark.s3
class TestRetryingS3BackendContract(BackendContract):
    """The whole contract through the proxy, with no faults: the wrapper changes nothing."""

    large_write_bytes = 2 * 5 * 2**20 + 2**20

    @pytest.fixture
    def backend(self, proxy: FaultProxy, s3_bucket: str) -> Backend:
        policy = RetryPolicy(deadline_s=20)
        return _s3_backend(proxy, s3_bucket, policy, default_block_size=5 * 2**20)
