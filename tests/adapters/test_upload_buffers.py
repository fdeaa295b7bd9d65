"""The host memory a writer's uploads hold beside the staged state, and who counts it.

Part buffers of S3 multipart uploads stay held while the next save stages, so they belong in
the staging envelope: ``SafeStorageWriter.upload_buffer_bytes`` says how many bytes, and the
``CheckpointManager`` subtracts them from the envelope of the budget it builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dcp_safe import (
    Bounds,
    CheckpointManager,
    MemoryBudget,
    SafeStorageWriter,
    Topology,
    WriterOptions,
)
from dcp_safe.backends.fsspec_backend import write_buffer_bytes
from dcp_safe.replication.copying import DEFAULT_CHUNK_BYTES

pytestmark = pytest.mark.s3

MIB = 1 << 20


def _options(s3_options: dict[str, Any], parts: int, block_mib: int) -> dict[str, Any]:
    return {**s3_options, "max_concurrency": parts, "default_block_size": block_mib * MIB}


def test_a_local_root_holds_no_upload_buffers(tmp_path: Path) -> None:
    assert SafeStorageWriter(tmp_path).upload_buffer_bytes == 0


def test_direct_s3_writes_hold_part_buffers_for_every_file_open_at_once(
    s3_root: str, s3_options: dict[str, Any]
) -> None:
    options = _options(s3_options, parts=3, block_mib=8)
    one = SafeStorageWriter(s3_root, storage_options=options)
    three = SafeStorageWriter(
        s3_root, storage_options=options, options=WriterOptions(thread_count=3)
    )
    per_file = write_buffer_bytes(one.backend)
    # (parts in flight + the block being filled) blocks of 8 MiB per open file
    assert per_file == (3 + 1) * 8 * MIB
    assert one.upload_buffer_bytes == per_file
    assert three.upload_buffer_bytes == 3 * per_file


def test_replication_adds_one_copy_chunk_and_one_file_of_part_buffers(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    writer = SafeStorageWriter(
        tmp_path, replicate_to=s3_root, storage_options=_options(s3_options, 2, 6)
    )
    assert writer.upload_buffer_bytes == DEFAULT_CHUNK_BYTES + (2 + 1) * 6 * MIB
    writer.close(timeout_s=30)


def test_the_manager_counts_upload_buffers_in_the_budget_it_builds(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    options = _options(s3_options, 4, 16)
    topology = Topology.of(tmp_path, replicate_to=s3_root, storage_options=options)
    manager = CheckpointManager(topology)
    try:
        buffers = manager.writer.upload_buffer_bytes
        assert buffers is not None and buffers >= 5 * 16 * MIB
        assert manager.stager.budget.other_consumers_bytes == buffers
        assert "other consumers" in manager.stager.budget.explain()
    finally:
        manager.close()


def test_a_budget_passed_in_is_the_callers(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    budget = MemoryBudget.from_host(other_consumers_bytes=7 * MIB)
    topology = Topology.of(tmp_path, replicate_to=s3_root, storage_options=s3_options)
    manager = CheckpointManager(topology, bounds=Bounds(budget=budget))
    try:
        assert manager.stager.budget is budget
        assert manager.stager.budget.other_consumers_bytes == 7 * MIB
    finally:
        manager.close()
