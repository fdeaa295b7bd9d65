"""``use_local_s3``: the docs' S3 examples' first line, a local S3 named in ``AWS_*``."""

from __future__ import annotations

import os
import uuid

import pytest
import s3fs
import torch

import dcp_safe
from dcp_safe.testing.s3 import use_local_s3

pytestmark = pytest.mark.s3

_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
)


def test_an_s3_url_works_with_no_storage_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _VARIABLES:
        monkeypatch.setenv(name, "not yet")  # and put back after the test
    bucket = f"docs-{uuid.uuid4().hex[:12]}"
    s3 = use_local_s3(bucket)
    try:
        assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint_url
        s3fs.S3FileSystem.clear_instance_cache()  # instances are cached by arguments, not env
        root = f"s3://{bucket}/run"
        state = {"w": torch.arange(8.0)}
        dcp_safe.save(
            state, checkpoint_id="step_1", storage_writer=dcp_safe.SafeStorageWriter(root)
        )
        assert [c.name for c in dcp_safe.list_checkpoints(root)] == ["step_1"]
        assert s3.keys(bucket, "run/step_1/_COMMITTED") == ["run/step_1/_COMMITTED"]
    finally:
        s3.stop()
        s3fs.S3FileSystem.clear_instance_cache()
