"""Replication to S3 (moto) with several multipart parts in flight per file, and its memory bound.

A shard of several blocks is uploaded by :class:`~dcp_safe.backends.s3_upload.S3MultipartWriter`
with ``max_concurrency`` parts in flight; what must hold is what held with one: the bytes are
verified while they stream, a failed part fails the replication with a typed, retryable error
and leaves no object and no open upload, and a later replication commits.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_fixtures import BLOCK_BYTES
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, StorageError, layout
from dcp_safe.backends.retry import is_transient
from dcp_safe.backends.roots import open_backend
from dcp_safe.replication.copying import DEFAULT_CHUNK_BYTES, copy_buffer_bytes
from dcp_safe.replication.replicator import Replicator, replicate_checkpoint
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.testing.s3_proxy import FaultProxy

pytestmark = pytest.mark.s3

# Only a guard against a hang if fewer parts than expected were ever in flight together.
_HANG_GUARD_S = 120.0
_PARTS = 3


def _big_state() -> dict[str, Any]:
    """The usual test state plus a tensor of a little over five blocks (so six parts)."""
    gen = torch.Generator().manual_seed(7)
    return {**make_state(7), "big": torch.randn((5 * BLOCK_BYTES + 4096) // 4, generator=gen)}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    local = tmp_path / "local"
    state = _big_state()
    dcp_safe.save(state, checkpoint_id="step_1", storage_writer=SafeStorageWriter(local))
    return local, state


def test_the_buffer_bound_counts_the_chunk_and_every_part_in_flight(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    remote = open_backend(s3_root, {**s3_options, "max_concurrency": _PARTS})
    with Replicator(open_backend(str(tmp_path)), remote, chunk_bytes=2**20) as replicator:
        assert replicator.max_buffer_bytes == 2**20 + (_PARTS + 1) * BLOCK_BYTES
    default = open_backend(s3_root, s3_options)
    assert copy_buffer_bytes(default, DEFAULT_CHUNK_BYTES) == DEFAULT_CHUNK_BYTES + 5 * BLOCK_BYTES
    assert copy_buffer_bytes(open_backend(str(tmp_path)), 10) == 10


def test_a_large_shard_replicates_with_several_parts_in_flight(
    saved: tuple[Path, dict[str, Any]],
    s3: LocalS3,
    s3_bucket: str,
    s3_root: str,
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local, state = saved
    options = {**s3_options, "max_concurrency": _PARTS}
    remote = open_backend(s3_root, options)
    fs = remote.inner.fs  # type: ignore[attr-defined]
    real = fs.call_s3
    # The first parts are held until _PARTS of them have been sent: with fewer in flight at
    # once the barrier breaks and the replication fails.
    together = threading.Barrier(_PARTS, timeout=_HANG_GUARD_S)
    lock = threading.Lock()
    sending = [0, 0]  # parts being sent now, the most at once

    def call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
        if method != "upload_part":
            return real(method, *args, **kwargs)
        with lock:
            sending[0] += 1
            sending[1] = max(sending)
        try:
            if kwargs["PartNumber"] <= _PARTS:
                together.wait()
            return real(method, *args, **kwargs)
        finally:
            with lock:
                sending[0] -= 1

    monkeypatch.setattr(fs, "call_s3", call_s3)
    replicate_checkpoint(open_backend(str(local)), remote, "step_1")
    assert sending == [0, _PARTS]
    assert s3.open_uploads(s3_bucket) == []
    dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    target = blank_like(state)
    reader = SafeStorageReader(s3_root, storage_options=s3_options)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert_state_equal(target, state)


def test_a_failed_part_fails_the_replication_typed_and_leaves_no_upload(
    saved: tuple[Path, dict[str, Any]],
    s3: LocalS3,
    s3_bucket: str,
    proxy: FaultProxy,
) -> None:
    local, _ = saved
    root = f"s3://{s3_bucket}/rep"
    options = proxy.storage_options(default_block_size=BLOCK_BYTES, max_concurrency=_PARTS)
    remote = open_backend(root, options)
    source = open_backend(str(local))
    # Part PUTs carry ?partNumber= (the proxy matches the path): the shard's only PUTs.
    fault = proxy.fail(503, "SlowDown", method="PUT", key=".distcp")

    with pytest.raises(StorageError, match="part") as info:
        replicate_checkpoint(source, remote, "step_1")
    assert fault.hits == 1
    assert is_transient(info.value)  # a writer's retry loop rewrites the file
    assert s3.keys(s3_bucket, "rep") == []
    assert s3.open_uploads(s3_bucket) == []

    replicate_checkpoint(source, remote, "step_1")  # the fault is spent: this one commits
    assert s3.open_uploads(s3_bucket) == []
    assert f"rep/step_1/{layout.COMMITTED_MARKER}" in s3.keys(s3_bucket, "rep")
