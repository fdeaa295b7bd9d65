"""S3 fixtures: one moto server per test session, a fresh bucket per test.

Registered once as a plugin by ``tests/conftest.py`` (``pytest_plugins``): a test asks for
``s3``, ``s3_bucket``, ``s3_options``, ``s3_root`` or ``proxy`` (a ``FaultProxy`` in front of
the server) by parameter name. Nothing here reaches beyond 127.0.0.1.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dcp_safe.testing.s3 import LocalS3, start_local_s3
from dcp_safe.testing.s3_proxy import FaultProxy

# Five MiB is S3's smallest multipart part; small blocks make multipart uploads cheap to test.
BLOCK_BYTES = 5 * 2**20


@pytest.fixture(scope="session")
def s3() -> Iterator[LocalS3]:
    server = start_local_s3()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3: LocalS3) -> str:
    return s3.create_bucket()


@pytest.fixture
def s3_options(s3: LocalS3) -> dict[str, Any]:
    return s3.storage_options(default_block_size=BLOCK_BYTES)


@pytest.fixture
def s3_root(s3_bucket: str) -> str:
    """A root URL under the test's own bucket."""
    return f"s3://{s3_bucket}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def proxy(s3: LocalS3) -> Iterator[FaultProxy]:
    """A ``FaultProxy`` in front of the session's server: faults injected on the wire."""
    with FaultProxy(s3.endpoint_url) as running:
        yield running
