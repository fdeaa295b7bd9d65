"""A local S3 for tests: moto's server on a free loopback port, with dummy credentials.

Nothing here talks to AWS. The server binds ``127.0.0.1`` on a port the kernel picks, and every
client this module hands out names the endpoint, the region and explicit dummy credentials, so
neither botocore nor s3fs goes looking for credentials (environment, config files, the EC2
metadata endpoint)::

    with local_s3() as s3:
        s3.create_bucket("ckpt")
        writer = SafeStorageWriter("s3://ckpt/run", storage_options=s3.storage_options())

Needs the test extra (``moto[server]``, ``boto3``).
"""

from __future__ import annotations

import atexit
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LocalS3", "local_s3", "start_local_s3", "use_local_s3"]

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def local_storage_options(endpoint_url: str, **extra: Any) -> dict[str, Any]:
    """s3fs options for a local S3 endpoint with the dummy credentials; ``extra`` adds or
    overrides top-level options."""
    options: dict[str, Any] = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "endpoint_url": endpoint_url,
        "client_kwargs": {"region_name": REGION},
    }
    options.update(extra)
    return options


@dataclass
class LocalS3:
    """A running moto S3 server.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
    """

    endpoint_url: str
    _server: Any = field(repr=False)

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """fsspec/s3fs options for this server; ``extra`` overrides or adds (e.g.
        ``default_block_size``)."""
        return local_storage_options(self.endpoint_url, **extra)

    def client(self, config: Any = None) -> Any:
        """A boto3 S3 client for this server (for setup and for inspecting what is stored);
        ``config``: a ``botocore.config.Config`` (connection pool, checksum policy)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=config,
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name when ``name`` is None) and return its name."""
        bucket = name or f"dcp-safe-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def open_uploads(self, bucket: str) -> list[dict[str, Any]]:
        """Multipart uploads still open in ``bucket`` (a failed write must leave none)."""
        uploads: list[dict[str, Any]] = (
            self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        )
        return uploads

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key in ``bucket`` under ``prefix``, sorted."""
        paginator = self.client().get_paginator("list_objects_v2")
        found: list[str] = []
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            found.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(found)

    def stop(self) -> None:
        """Shut the server down."""
        self._server.stop()


def start_local_s3() -> LocalS3:
    """Start moto's S3 server on ``127.0.0.1`` and a free port. Call ``stop()`` when done."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return LocalS3(endpoint_url=f"http://{host}:{port}", _server=server)


@contextmanager
def local_s3() -> Iterator[LocalS3]:
    """A moto S3 server for the duration of the ``with`` block."""
    s3 = start_local_s3()
    try:
        yield s3
    finally:
        s3.stop()


def use_local_s3(*buckets: str) -> LocalS3:
    """Start a local S3 (moto, ``127.0.0.1``, a free port) with ``buckets``, and point this
    process's ``AWS_*`` variables at it (endpoint, region, dummy credentials): the docs' S3
    examples start with it, so ``s3://bucket/...`` works in them as it does with a real endpoint
    and credentials in the environment. Processes started afterwards inherit the variables. The
    server stops when the interpreter exits (or on ``stop()``); its request log stays quiet.
    """
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    s3 = start_local_s3()
    atexit.register(s3.stop)
    for bucket in buckets:
        s3.create_bucket(bucket)
    os.environ.update(
        AWS_ENDPOINT_URL=s3.endpoint_url,
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION=REGION,
    )
    return s3
