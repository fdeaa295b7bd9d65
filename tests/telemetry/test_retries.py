"""Retries of a real S3 save behind a fault proxy reach the telemetry as ``retry`` marks."""

from __future__ import annotations

from typing import Any

import pytest
from support import make_state

from dcp_safe import layout
from dcp_safe.adapters import api
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.backends.retry import RetryPolicy
from dcp_safe.telemetry import EventKind, PrometheusSink, Telemetry
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy

pytestmark = pytest.mark.s3


def test_each_transient_failure_is_marked_as_a_retry_and_counted(
    s3: LocalS3,
    s3_bucket: str,
) -> None:
    with FaultProxy(s3.endpoint_url) as proxy, Telemetry(sample_memory=False) as tel:
        prometheus = PrometheusSink(tel)
        options: dict[str, Any] = proxy.storage_options(
            config_kwargs={"connect_timeout": 2, "read_timeout": 2},
            default_block_size=5 * 2**20,
        )
        shard = proxy.fail(503, "SlowDown", method="PUT", key=".distcp", times=1)
        marker = proxy.fail(503, "SlowDown", method="PUT", key=layout.COMMITTED_MARKER, times=1)
        policy = RetryPolicy(
            deadline_s=10.0, base_delay_s=0.01, max_delay_s=0.05, on_retry=tel.on_retry
        )
        writer = tel.wrap_writer(
            SafeStorageWriter(f"s3://{s3_bucket}/retries", storage_options=options, retry=policy)
        )
        api.save(make_state(0), checkpoint_id="step_1", storage_writer=writer, no_dist=True)
        assert shard.hits == 1 and marker.hits == 1
        retries = [e for e in tel.memory.events(EventKind.MARK) if e.name == "retry"]
        assert len(retries) == 2
        assert tel.report().retries == 2
        assert "dcp_safe_retries_total 2.0" in prometheus.exposition()
        saves = [e for e in tel.memory.events(EventKind.SPAN_END) if e.name == "save"]
        assert len(saves) == 1 and saves[0].ok
