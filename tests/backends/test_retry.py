"""RetryPolicy, is_transient and call_with_retries, on a fake clock (nothing really sleeps)."""

from __future__ import annotations

import asyncio
import errno
import pickle
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from s3fs.errors import translate_boto_error

from dcp_safe.backends.retry import RetryPolicy, call_with_retries, is_transient
from dcp_safe.errors import (
    AdmissionTimeoutError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    StorageError,
)


class FakeClock:
    """A monotonic clock that moves only when slept on or told to."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def _policy(clock: FakeClock, *, rand: float = 1.0, **kw: Any) -> RetryPolicy:
    return RetryPolicy(sleep=clock.sleep, clock=clock.clock, random=lambda: rand, **kw)


def _client_error(code: str, status: int, op: str = "PutObject") -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": f"{code} message"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, op)


def _s3fs(code: str, status: int) -> BaseException:
    """What s3fs raises for an S3 error reply."""
    translated: BaseException = translate_boto_error(_client_error(code, status))
    return translated


def _wrapped(exc: BaseException) -> StorageError:
    """What FsspecBackend raises for an OSError from s3fs."""
    try:
        raise StorageError("write", "s3://b/k", exc) from exc
    except StorageError as wrapped:
        return wrapped


def _raised_while_handling(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised inside ``except inner`` (as botocore wraps aiohttp errors)."""
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - the implicit __context__ is the point
    except BaseException as exc:
        return exc


def _failing(errors: list[BaseException], result: object = "ok") -> Callable[[], object]:
    def fn() -> object:
        if errors:
            raise errors.pop(0)
        return result

    return fn


# ------------------------------------------------------------------ the policy


def test_policy_defaults() -> None:
    policy = RetryPolicy()
    assert (policy.deadline_s, policy.attempts, policy.base_delay_s, policy.max_delay_s) == (
        60.0,
        8,
        0.1,
        5.0,
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"deadline_s": 0},
        {"deadline_s": -1},
        {"deadline_s": float("inf")},
        {"deadline_s": float("nan")},
        {"attempts": 0},
        {"attempts": 2.5},
        {"attempts": True},
        {"base_delay_s": -0.1},
        {"max_delay_s": 0.01},
        {"max_delay_s": float("inf")},
        {"deadline_s": "60"},
    ],
)
def test_policy_rejects_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kw)


def test_policy_is_frozen_and_keyword_only() -> None:
    policy = RetryPolicy()
    with pytest.raises(AttributeError):
        policy.attempts = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RetryPolicy(60.0)  # type: ignore[misc]


def test_default_policy_pickles() -> None:
    policy = RetryPolicy(deadline_s=3, attempts=4)
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_backoff_is_capped_exponential_times_jitter() -> None:
    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0, random=lambda: 0.5)
    assert [policy.backoff_s(n) for n in range(6)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    assert policy.backoff_s(10_000) == pytest.approx(0.5)  # no overflow on huge retry counts


# ------------------------------------------------------------------ classification

TRANSIENT = {
    "500 InternalError (s3fs)": _s3fs("InternalError", 500),
    "503 SlowDown (s3fs)": _s3fs("SlowDown", 503),
    "503 ServiceUnavailable (s3fs)": _s3fs("ServiceUnavailable", 503),
    "RequestTimeout (s3fs)": _s3fs("RequestTimeout", 400),
    "bare 502 (s3fs)": _s3fs("502", 502),
    "bare 504 ClientError": _client_error("504", 504),
    "SlowDown ClientError": _client_error("SlowDown", 503),
    "wrapped 503 (FsspecBackend)": _wrapped(_s3fs("SlowDown", 503)),
    "read timeout": ReadTimeoutError(endpoint_url="http://x"),
    "connect timeout": ConnectTimeoutError(endpoint_url="http://x"),
    "endpoint connection": EndpointConnectionError(endpoint_url="http://x"),
    "dropped reply": ConnectionClosedError(endpoint_url="http://x"),
    "wrapped read timeout": _wrapped(ReadTimeoutError(endpoint_url="http://x")),
    "aiohttp disconnected": aiohttp.ServerDisconnectedError(),
    "aiohttp connection": aiohttp.ClientConnectionError(),
    "asyncio timeout": asyncio.TimeoutError(),
    "builtin timeout": TimeoutError(),
    "connection reset": ConnectionResetError(errno.ECONNRESET, "reset"),
    "broken pipe": BrokenPipeError(),
    "OSError raised while handling a reset": _raised_while_handling(
        OSError(errno.EIO, "io"), ConnectionResetError()
    ),
}

FINAL = {
    "404 (s3fs)": _s3fs("NoSuchKey", 404),
    "403 (s3fs)": _s3fs("AccessDenied", 403),
    "412 If-None-Match": translate_boto_error(
        ClientError(
            {
                "Error": {"Code": "PreconditionFailed", "Condition": "If-None-Match"},
                "ResponseMetadata": {"HTTPStatusCode": 412},
            },
            "PutObject",
        )
    ),
    "400 InvalidArgument ClientError": _client_error("InvalidArgument", 400),
    "FileNotFoundError": FileNotFoundError(),
    "FileExistsError": FileExistsError(),
    "PermissionError": PermissionError(),
    "ConfigError": ConfigError("bad"),
    "CheckpointCorruptError": CheckpointCorruptError("p", "bad checksum"),
    "CheckpointNotFoundError": CheckpointNotFoundError("p"),
    "AdmissionTimeoutError (a TimeoutError)": AdmissionTimeoutError("waited"),
    "StorageError with no cause": StorageError("write", "p", "disk full"),
    "TLS failure": SSLError(endpoint_url="http://x", error="bad cert"),
    "plain OSError": OSError(errno.ENOSPC, "no space"),
    "ValueError": ValueError("x"),
    "404 raised while handling a timeout": _raised_while_handling(
        FileNotFoundError(), TimeoutError()
    ),
}


@pytest.mark.parametrize("exc", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", FINAL.values(), ids=FINAL.keys())
def test_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_s3fs_translation_keeps_the_client_error_as_cause() -> None:
    # The classifier depends on this: if s3fs stopped chaining, 5xx would look final.
    exc = _s3fs("SlowDown", 503)
    assert type(exc) is OSError and isinstance(exc.__cause__, ClientError)


def test_cyclic_chain_terminates() -> None:
    a, b = OSError("a"), OSError("b")
    a.__context__, b.__context__ = b, a
    assert not is_transient(a)


# ------------------------------------------------------------------ the loop


def test_success_needs_no_sleep() -> None:
    clock = FakeClock()
    assert call_with_retries("read", "s3://b/k", lambda: 7, _policy(clock)) == 7
    assert clock.sleeps == []


def test_transient_failures_are_retried_with_growing_backoff() -> None:
    clock = FakeClock()
    errors: list[BaseException] = [_s3fs("SlowDown", 503), ConnectionResetError(), TimeoutError()]
    result = call_with_retries("write", "s3://b/k", _failing(errors), _policy(clock))
    assert result == "ok"
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4])


def test_non_transient_error_passes_through_unchanged_and_at_once() -> None:
    clock = FakeClock()
    original = FileNotFoundError(errno.ENOENT, "gone", "s3://b/k")
    with pytest.raises(FileNotFoundError) as info:
        call_with_retries("read", "s3://b/k", _failing([TimeoutError(), original]), _policy(clock))
    assert info.value is original
    assert len(clock.sleeps) == 1


def test_attempts_run_out() -> None:
    clock = FakeClock()
    calls = []

    def fn() -> None:
        calls.append(1)
        raise _s3fs("InternalError", 500)

    with pytest.raises(StorageError) as info:
        call_with_retries("stat", "s3://b/run/x", fn, _policy(clock, attempts=3))
    assert len(calls) == 3 and len(clock.sleeps) == 2
    error = info.value
    assert error.operation == "stat" and error.path == "s3://b/run/x"
    assert "s3://b/run/x" in str(error) and "3 attempt" in str(error)
    assert isinstance(error.__cause__, OSError) and is_transient(error.__cause__)


def test_deadline_runs_out_without_sleeping_past_it() -> None:
    clock = FakeClock()

    def fn() -> None:
        clock.now += 0.7  # each try takes a while
        raise ReadTimeoutError(endpoint_url="http://x")

    policy = _policy(clock, deadline_s=3.0, attempts=100, base_delay_s=0.5, max_delay_s=0.5)
    start = clock.now
    with pytest.raises(StorageError) as info:
        call_with_retries("read", "s3://b/k", fn, policy)
    assert sum(clock.sleeps) <= 3.0
    assert clock.now - start <= 3.0 + 0.7  # at most one try runs across the deadline
    assert isinstance(info.value.__cause__, ReadTimeoutError)


def test_one_attempt_means_no_retry() -> None:
    clock = FakeClock()
    with pytest.raises(StorageError):
        call_with_retries("read", "p", _failing([TimeoutError()]), _policy(clock, attempts=1))
    assert clock.sleeps == []


def test_keyboard_interrupt_is_never_retried() -> None:
    clock = FakeClock()
    with pytest.raises(KeyboardInterrupt):
        call_with_retries("read", "p", _failing([KeyboardInterrupt()]), _policy(clock))
    assert clock.sleeps == []


@settings(max_examples=300, deadline=None)
@given(
    deadline_s=st.floats(0.01, 120),
    attempts=st.integers(1, 50),
    base_delay_s=st.floats(0, 10),
    extra_delay_s=st.floats(0, 30),
    jitter=st.floats(0, 0.999),
    try_s=st.lists(st.floats(0, 5), min_size=1, max_size=60),
    succeed_at=st.integers(1, 60),
)
def test_total_sleep_never_exceeds_the_deadline(
    deadline_s: float,
    attempts: int,
    base_delay_s: float,
    extra_delay_s: float,
    jitter: float,
    try_s: list[float],
    succeed_at: int,
) -> None:
    clock = FakeClock()
    policy = _policy(
        clock,
        rand=jitter,
        deadline_s=deadline_s,
        attempts=attempts,
        base_delay_s=base_delay_s,
        max_delay_s=base_delay_s + extra_delay_s,
    )
    start = clock.now
    starts: list[float] = []

    def fn() -> str:
        starts.append(clock.now)
        clock.now += try_s[(len(starts) - 1) % len(try_s)]
        if len(starts) >= succeed_at:
            return "ok"
        raise ConnectionResetError()

    try:
        call_with_retries("write", "s3://b/k", fn, policy)
    except StorageError as exc:
        assert isinstance(exc.__cause__, ConnectionResetError)
    assert sum(clock.sleeps) <= deadline_s
    assert len(starts) <= attempts
    assert all(t < start + deadline_s for t in starts)  # no try starts after the deadline
