"""SafeStorageWriter(replicate_to=...) on several ranks: each rank uploads the files it wrote.

Real gloo ranks share one local root; the remote is moto S3 (seen by each rank through a
``faulty://`` wrapper whose injector records which objects that rank's process wrote, and fails
one rank's upload on purpose) or a second local directory (which publishes by rename). Checked:
each rank wrote exactly the objects of its own rank manifest (rank 0 also ``.metadata``,
``manifest.json``, ``_COMMITTED`` and the writing lease), the remote checkpoint is the local one
byte for byte and loads exactly; a failed upload on one rank fails every rank's replication
future with a ``CommitError`` naming that rank, through storage markers, and nothing is
committed remotely.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_state_equal, blank_tree, rank_union

import dcp_safe
from dcp_safe import SafeStorageReader, SafeStorageWriter, WriterOptions, layout, list_checkpoints
from dcp_safe.backends.roots import open_backend
from dcp_safe.manifest.schema import RankManifest
from dcp_safe.replication.rank_upload import UploadOptions
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.topology import Root

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

FAST = UploadOptions(remote_timeout_s=60.0, poll_s=0.05)
# Object writes: a PUT (pipe_file, or s3fs's put_object) and a completed multipart upload.
_WRITE_KINDS = frozenset({"pipe", "close"})


def _rank_state(rank: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    return {
        f"rank{rank}.weight": torch.randn(16, 8, generator=gen),
        f"rank{rank}.steps": torch.arange(5, dtype=torch.int64) + seed + rank,
        f"rank{rank}.meta": {"owner": rank, "seed": seed},
    }


class _RecordingInjector(FaultInjector):
    """A fault injector that also records every object this process writes (its keys)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.written: list[str] = []

    def before(self, kind: str, path: str) -> Any:
        if kind in _WRITE_KINDS:
            self.written.append(path)
        return super().before(kind, path)


# --------------------------------------------------------------- rank functions (module level)


def _save_to_s3(
    rank: int, world_size: int, local: str, bucket_prefix: str, s3_options: dict[str, Any]
) -> dict[str, Any]:
    faults = _RecordingInjector()
    options = {"target_protocol": "s3", "target_options": s3_options, "faults": faults}
    writer = SafeStorageWriter(
        local,
        replicate_to=Root(f"faulty://{bucket_prefix}", storage_options=options),
        replication_options=FAST,
        options=WriterOptions(fsync=False),
    )
    seen: dict[str, Any] = {}

    dcp_safe.save(_rank_state(rank, 1), checkpoint_id="step_1", storage_writer=writer)
    seen["replicated"] = writer.replication("step_1").result(timeout=120).save_id
    seen["written"] = sorted(
        {key.removeprefix(f"{bucket_prefix}/") for key in faults.written if "/step_1/" in key}
    )

    if rank == 1:  # this rank's first object write of step_2 (its shard) fails, once (EIO)
        faults.reset(FaultPlan(fail_at=1, ops=("pipe", "close"), torn=False))
    dcp_safe.save(_rank_state(rank, 2), checkpoint_id="step_2", storage_writer=writer)
    error = writer.replication("step_2").exception(timeout=120)
    seen["failure"] = (type(error).__name__, getattr(error, "failures", None), str(error))
    writer.close(timeout_s=60)  # raises nothing: the one failure was retrieved above
    return seen


def _save_to_second_root(rank: int, world_size: int, local: str, remote: str) -> str:
    writer = SafeStorageWriter(
        local, replicate_to=remote, replication_options=FAST, options=WriterOptions(fsync=False)
    )
    dcp_safe.save(_rank_state(rank, 3), checkpoint_id="step_3", storage_writer=writer)
    save_id = writer.replication("step_3").result(timeout=120).save_id
    writer.close(timeout_s=60)
    return save_id


# --------------------------------------------------------------- tests


@pytest.mark.s3
def test_each_rank_uploads_its_own_files_and_a_failed_upload_fails_every_rank(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    local = tmp_path / "local"
    prefix = s3_root.removeprefix("s3://")

    per_rank = run_ranks(_save_to_s3, 2, args=(str(local), prefix, s3_options), timeout_s=240)

    # step_1: committed on S3, by one save, with each rank's own objects written by that rank.
    local_manifest = (local / "step_1" / layout.MANIFEST).read_bytes()
    assert len({seen["replicated"] for seen in per_rank}) == 1
    remote = open_backend(s3_root, s3_options)
    assert remote.read_bytes(f"step_1/{layout.MANIFEST}") == local_manifest
    for rank, seen in enumerate(per_rank):
        rel = layout.rank_manifest_name(rank)
        part = RankManifest.from_json((local / "step_1" / rel).read_bytes(), rel)
        own = {f"step_1/{f.path}" for f in part.files} | {f"step_1/{rel}"}
        assert any(f.path.endswith(layout.SHARD_SUFFIX) for f in part.files)
        if rank == 0:
            own |= {f"step_1/{n}" for n in (layout.DCP_METADATA, layout.MANIFEST)}
            own.add(f"step_1/{layout.COMMITTED_MARKER}")
            own.add(f"step_1/{layout.WRITING_LEASE}")  # taken before any rank uploads
        assert sorted(own) == seen["written"], rank
    dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    expected = rank_union(_rank_state, 2, 1)
    target = blank_tree(expected)
    reader = SafeStorageReader(s3_root, storage_options=s3_options)
    dcp_safe.load(target, checkpoint_id="step_1", storage_reader=reader)
    assert_state_equal(target, expected)

    # step_2: committed locally; rank 1's upload failed, so every rank's future names rank 1
    # and nothing of it is committed remotely.
    assert [c.name for c in list_checkpoints(local)] == ["step_1", "step_2"]
    for rank, seen in enumerate(per_rank):
        kind, failures, message = seen["failure"]
        assert kind == "CommitError", (rank, message)
        assert list(failures) == [1], (rank, message)
        assert "injected fault" in message, (rank, message)
    assert [c.name for c in list_checkpoints(s3_root, storage_options=s3_options)] == ["step_1"]
    assert not remote.exists(f"step_2/{layout.COMMITTED_MARKER}")
    leftovers = [p for p in remote.walk_files("step_2") if p.endswith(layout.SHARD_SUFFIX)]
    assert leftovers == []  # each rank removed what it had uploaded


def test_replication_to_a_second_local_root_publishes_by_rename(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    save_ids = run_ranks(_save_to_second_root, 2, args=(str(local), str(remote)), timeout_s=240)

    assert len(set(save_ids)) == 1
    assert sorted(p.name for p in remote.iterdir()) == ["step_3"]  # no partial left behind
    name = "step_3"
    assert (remote / name / layout.MANIFEST).read_bytes() == (
        local / name / layout.MANIFEST
    ).read_bytes()
    dcp_safe.verify_checkpoint(str(remote), name)
    expected = rank_union(_rank_state, 2, 3)
    target = blank_tree(expected)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(remote))
    assert_state_equal(target, expected)
