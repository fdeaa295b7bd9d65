"""FaultProxy: forwards faithfully, and each fault does what it says."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, HTTPClientError, ReadTimeoutError

from dcp_safe.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY, LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy

pytestmark = pytest.mark.s3


def _client(endpoint_url: str, read_timeout_s: float = 30) -> Any:
    """A boto3 client that tries each request once."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(
            retries={"mode": "standard", "total_max_attempts": 1},
            read_timeout=read_timeout_s,
            connect_timeout=5,
        ),
    )


@pytest.fixture
def via(proxy: FaultProxy) -> Iterator[Any]:
    """A client that goes through the proxy."""
    client = _client(proxy.url)
    yield client
    client.close()


@pytest.fixture
def direct(s3: LocalS3) -> Iterator[Any]:
    """A client that goes straight to moto, to see what really is stored."""
    client = _client(s3.endpoint_url)
    yield client
    client.close()


def _exists(client: Any, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return False
        raise
    return True


# ------------------------------------------------------------------ forwarding


def test_forwards_objects_metadata_ranges_and_listings(
    proxy: FaultProxy,
    via: Any,
    direct: Any,
    s3_bucket: str,
) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB, every byte value
    via.put_object(Bucket=s3_bucket, Key="dir/a b+c", Body=body, Metadata={"who": "proxy"})
    stored = direct.get_object(Bucket=s3_bucket, Key="dir/a b+c")
    assert stored["Body"].read() == body and stored["Metadata"] == {"who": "proxy"}

    got = via.get_object(Bucket=s3_bucket, Key="dir/a b+c", Range="bytes=10-19")
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert got["Body"].read() == body[10:20]
    assert via.head_object(Bucket=s3_bucket, Key="dir/a b+c")["ContentLength"] == len(body)

    via.put_object(Bucket=s3_bucket, Key="other/x", Body=b"")
    listed = via.list_objects_v2(Bucket=s3_bucket, Prefix="dir/")
    assert [o["Key"] for o in listed["Contents"]] == ["dir/a b+c"]

    via.delete_object(Bucket=s3_bucket, Key="dir/a b+c")
    assert not _exists(direct, s3_bucket, "dir/a b+c")
    assert proxy.requests_seen >= 6 and proxy.requests_faulted == 0
    assert proxy.requests("PUT", "/dir/a b+c") == [f"/{s3_bucket}/dir/a b+c"]


def test_forwards_multipart_uploads_and_conditional_writes(
    via: Any,
    direct: Any,
    s3_bucket: str,
) -> None:
    part = b"p" * (5 * 2**20)
    upload = via.create_multipart_upload(Bucket=s3_bucket, Key="big")
    etags = [
        via.upload_part(
            Bucket=s3_bucket, Key="big", UploadId=upload["UploadId"], PartNumber=n, Body=part
        )["ETag"]
        for n in (1, 2)
    ]
    via.complete_multipart_upload(
        Bucket=s3_bucket,
        Key="big",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"ETag": e, "PartNumber": n} for n, e in enumerate(etags, 1)]},
    )
    assert direct.get_object(Bucket=s3_bucket, Key="big")["Body"].read() == part * 2

    via.put_object(Bucket=s3_bucket, Key="marker", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as info:
        via.put_object(Bucket=s3_bucket, Key="marker", Body=b"2", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_forwards_chunked_bodies_over_one_kept_alive_connection(
    proxy: FaultProxy,
    direct: Any,
    s3_bucket: str,
) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for i in range(3):
            conn.request(
                "PUT",
                f"/{s3_bucket}/chunked-{i}",
                body=iter([b"hello ", b"chunked ", str(i).encode()]),
                encode_chunked=True,
            )
            response = conn.getresponse()
            response.read()
            assert response.status == 200
    finally:
        conn.close()
    for i in range(3):
        stored = direct.get_object(Bucket=s3_bucket, Key=f"chunked-{i}")["Body"].read()
        assert stored == f"hello chunked {i}".encode()


# ------------------------------------------------------------------ faults


@pytest.mark.parametrize(("status", "code"), [(500, "InternalError"), (503, "SlowDown")])
def test_fail_answers_with_an_s3_error_and_does_not_forward(
    proxy: FaultProxy,
    via: Any,
    direct: Any,
    s3_bucket: str,
    status: int,
    code: str,
) -> None:
    fault = proxy.fail(status, code, method="PUT", key="/k", times=2)
    for _ in range(2):
        with pytest.raises(ClientError) as info:
            via.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
        assert info.value.response["Error"]["Code"] == code
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
        assert not _exists(direct, s3_bucket, "k")  # never reached the server
    via.put_object(Bucket=s3_bucket, Key="k", Body=b"x")  # the fault is spent
    assert fault.hits == 2 and proxy.requests_faulted == 2
    assert len(proxy.requests("PUT", "/k")) == 3


def test_fail_on_head_has_no_body(
    proxy: FaultProxy,
    via: Any,
    s3_bucket: str,
) -> None:
    via.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
    proxy.fail(503, "SlowDown", method="HEAD")
    with pytest.raises(ClientError) as info:
        via.head_object(Bucket=s3_bucket, Key="k")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert via.head_object(Bucket=s3_bucket, Key="k")["ContentLength"] == 1  # stream in sync


def test_persistent_fault_and_matching_by_method_and_key(
    proxy: FaultProxy,
    via: Any,
    s3_bucket: str,
) -> None:
    fault = proxy.fail(500, "InternalError", method="GET", key="/bad", times=None)
    via.put_object(Bucket=s3_bucket, Key="bad", Body=b"x")  # PUT: not matched
    via.put_object(Bucket=s3_bucket, Key="good", Body=b"y")
    assert via.get_object(Bucket=s3_bucket, Key="good")["Body"].read() == b"y"  # key: not matched
    for _ in range(4):
        with pytest.raises(ClientError):
            via.get_object(Bucket=s3_bucket, Key="bad")
    assert fault.hits == 4
    proxy.clear()
    assert via.get_object(Bucket=s3_bucket, Key="bad")["Body"].read() == b"x"


def test_delay_outlasts_a_short_read_timeout_but_the_write_is_applied(
    proxy: FaultProxy,
    direct: Any,
    s3_bucket: str,
) -> None:
    impatient = _client(proxy.url, read_timeout_s=1)
    try:
        fault = proxy.delay(4, method="PUT", key="/slow")
        with pytest.raises(ReadTimeoutError):
            impatient.put_object(Bucket=s3_bucket, Key="slow", Body=b"late")
        assert fault.hits == 1
    finally:
        impatient.close()
    assert direct.get_object(Bucket=s3_bucket, Key="slow")["Body"].read() == b"late"


def test_drop_reply_applies_the_request_and_closes_without_answering(
    proxy: FaultProxy,
    via: Any,
    direct: Any,
    s3_bucket: str,
) -> None:
    fault = proxy.drop_reply(method="PUT", key="/lost")
    with pytest.raises(HTTPClientError):  # ConnectionClosedError: no reply at all
        via.put_object(Bucket=s3_bucket, Key="lost", Body=b"applied")
    assert fault.hits == 1
    assert direct.get_object(Bucket=s3_bucket, Key="lost")["Body"].read() == b"applied"
    via.put_object(Bucket=s3_bucket, Key="lost", Body=b"again")  # next one is answered


def test_rejects_bad_arguments(s3: LocalS3) -> None:
    with pytest.raises(ValueError):
        FaultProxy("https://example.invalid")
    with FaultProxy(s3.endpoint_url) as proxy, pytest.raises(ValueError):
        proxy.fail(times=0)


# ------------------------------------------------------------------ lifecycle


def test_stop_closes_connections_and_leaves_no_thread(
    s3: LocalS3,
    s3_bucket: str,
) -> None:
    before = set(threading.enumerate())
    with FaultProxy(s3.endpoint_url) as proxy:
        client = _client(proxy.url)
        client.put_object(Bucket=s3_bucket, Key=f"k-{uuid.uuid4().hex}", Body=b"x")
        proxy.delay(60, method="GET")  # a reply held when the proxy stops
        host, port = proxy.url.removeprefix("http://").split(":")
        held = threading.Thread(
            target=lambda: _swallow(lambda: client.list_objects_v2(Bucket=s3_bucket))
        )
        held.start()
        while not proxy.requests("GET"):
            threading.Event().wait(0.01)
    held.join(timeout=60)
    client.close()
    assert not held.is_alive()
    assert set(threading.enumerate()) <= before
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
        pass


def _swallow(fn: Any) -> None:
    # The held request fails when the proxy stops: that is the point.
    with contextlib.suppress(Exception):
        fn()
