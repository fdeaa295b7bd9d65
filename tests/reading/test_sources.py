"""Restoring from node caches: ``SafeStorageReader(node_cache=)`` reads local files, the remote
decides.

The two-node case is simulated as in ``test_node_local.py``: four gloo ranks, ranks 0-1 on
"node A"'s local root and 2-3 on "node B"'s, one moto S3 root. After a ``NodeLocalWriter`` save,
a restart on the same topology reads every file from its node's cache; a corrupted cached file
is read from S3 instead and reported; a cache of another save of the same name is ignored; a
load on one process (resharded) reads what node A has and the rest from S3. One-process cases
(a local directory as the remote) cover the other reasons a cache or a file is passed over.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from support import shard_rows
from torch.distributed.tensor import DTensor

import dcp_safe
from dcp_safe import CheckpointNotFoundError, layout
from dcp_safe.adapters.node_local import NodeLocalOptions, NodeLocalWriter
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.checkpoints.node_cache import NODE_COMMITTED_MARKER, list_node_caches
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.reading.sources import (
    CacheRejection,
    NodeCacheStats,
    ReadSource,
    RejectionReason,
)
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.topology import Root

pytestmark = [pytest.mark.timeout(300)]

RANKS_PER_NODE = 2
W_SHAPE, B_LEN = (8, 4), 6
FAST = NodeLocalOptions(remote_timeout_s=120.0, poll_s=0.25)
NAME = "step_1"


def _full_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(*W_SHAPE, generator=gen), "b": torch.randn(B_LEN, generator=gen)}


def _zeros() -> dict[str, Any]:
    return {"w": torch.zeros(W_SHAPE), "b": torch.zeros(B_LEN)}


def _flip_item_byte(cache: Path, file_name: str, fqn: str) -> None:
    """Flip one byte in the middle of ``fqn``'s bytes in a cached file (its size unchanged)."""
    manifest = Manifest.from_json((cache / layout.MANIFEST).read_bytes(), str(cache))
    [item] = [i for i in manifest.items if i.file == file_name and i.fqn == fqn]
    path = cache / file_name
    data = bytearray(path.read_bytes())
    data[item.start + item.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_cache_manifest(cache: Path, *, save_id: str, update_marker: bool) -> None:
    """Make the cache's manifest another save's; with ``update_marker`` a consistent one."""
    manifest = (cache / layout.MANIFEST).read_text(encoding="utf-8")
    original = Manifest.from_json(manifest.encode(), str(cache)).save_id
    raw = manifest.replace(original, save_id).encode()
    (cache / layout.MANIFEST).write_bytes(raw)
    if update_marker:
        (cache / NODE_COMMITTED_MARKER).write_text(manifest_digest(raw))


# --------------------------------------------------------------- rank functions (module level)


def _save_on_two_nodes(
    rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any]
) -> str:
    root = roots[rank // RANKS_PER_NODE]
    writer = NodeLocalWriter(root, remote=Root(remote, options), node_options=FAST)
    dcp_safe.save(shard_rows(world_size, _full_state(1)), checkpoint_id=NAME, storage_writer=writer)
    save_id = writer.replication(NAME).result(timeout=120).save_id
    writer.close(timeout_s=60)
    return save_id


def _restore_on_two_nodes(
    rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any]
) -> dict[str, Any]:
    target = shard_rows(world_size, _zeros())
    reader = SafeStorageReader(
        remote, node_cache=roots[rank // RANKS_PER_NODE], storage_options=options
    )
    dcp_safe.load(target, checkpoint_id="latest", storage_reader=reader)
    assert isinstance(target["w"], DTensor) and isinstance(target["b"], DTensor)
    return {
        "w_local": target["w"].to_local(),
        "w": target["w"].full_tensor(),
        "b": target["b"].full_tensor(),
        "stats": reader.stats(),
    }


def _check_exact(restored: list[dict[str, Any]]) -> None:
    expected = _full_state(1)
    for rank, seen in enumerate(restored):
        assert torch.equal(seen["w"], expected["w"]) and torch.equal(seen["b"], expected["b"])
        assert torch.equal(seen["w_local"], expected["w"].chunk(4)[rank])


# --------------------------------------------------------------- tests


@pytest.mark.multiproc
@pytest.mark.s3
def test_a_same_topology_restart_reads_its_node_caches_and_falls_back_to_s3_per_file(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    node_a, node_b = tmp_path / "node_a", tmp_path / "node_b"
    roots = [str(node_a), str(node_b)]
    [save_id] = set(run_ranks(_save_on_two_nodes, 4, args=(roots, s3_root, s3_options)))

    # Same topology, intact caches: every rank reads its one file from its node's cache.
    restored = run_ranks(_restore_on_two_nodes, 4, args=(roots, s3_root, s3_options))
    _check_exact(restored)
    for rank, seen in enumerate(restored):
        node = roots[rank // RANKS_PER_NODE]
        stats = seen["stats"]
        assert stats == NodeCacheStats(
            cache_path=str(Path(node) / NAME),
            files_from_cache=1,
            files_from_remote=0,
            rejections=(),
            bytes_from_cache=stats.bytes_from_cache,  # counted, and nothing from elsewhere:
        )
        assert stats.bytes_from_cache > 0

    # Another topology (one process, resharded from four ranks) on node A: what A holds is read
    # locally, node B's files come from S3, each reported as missing from this cache.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    whole = _zeros()
    reader = SafeStorageReader(s3_root, node_cache=node_a, storage_options=s3_options)
    dcp_safe.load(whole, storage_reader=reader)
    expected = _full_state(1)
    assert torch.equal(whole["w"], expected["w"]) and torch.equal(whole["b"], expected["b"])
    stats = reader.stats()
    assert (stats.files_from_cache, stats.files_from_remote) == (2, 2)
    assert sorted((r.file, r.reason) for r in stats.rejections) == [
        (layout.shard_file_name(2, 0), RejectionReason.MISSING),
        (layout.shard_file_name(3, 0), RejectionReason.MISSING),
    ]

    # A flipped byte in rank 1's cached shard; node B's cache is another save of this name.
    broken = layout.shard_file_name(1, 0)
    _flip_item_byte(node_a / NAME, broken, "w")
    _rewrite_cache_manifest(node_b / NAME, save_id="an-older-save", update_marker=True)
    assert [cache.manifest.save_id for cache in list_node_caches(node_b)] == ["an-older-save"]

    restored = run_ranks(_restore_on_two_nodes, 4, args=(roots, s3_root, s3_options))
    _check_exact(restored)
    stats_of = [seen["stats"] for seen in restored]
    assert (stats_of[0].files_from_cache, stats_of[0].rejections) == (1, ())
    assert (stats_of[1].files_from_cache, stats_of[1].files_from_remote) == (0, 1)
    [rejection] = stats_of[1].rejections
    assert (rejection.file, rejection.reason) == (broken, RejectionReason.CHECKSUM)
    assert "checksum mismatch" in rejection.detail
    for stats in stats_of[2:]:  # ignored entirely: nothing read from it
        assert stats.cache_path is None
        assert (stats.files_from_cache, stats.files_from_remote) == (0, 1)
        [rejection] = stats.rejections
        assert (rejection.file, rejection.reason) == (None, RejectionReason.STALE)
        assert "an-older-save" in rejection.detail and save_id in rejection.detail


# --------------------------------------------------------------- one process


@pytest.fixture
def saved(tmp_path: Path, memory_root: str) -> tuple[Path, str]:
    """``step_1`` (tensors and a non-tensor item) saved through one node: (node root, remote)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    node = tmp_path / "node"
    options = NodeLocalOptions(remote_timeout_s=60.0, poll_s=0.01)
    writer = NodeLocalWriter(node, remote=memory_root, node_options=options)
    state = {**_full_state(1), "meta": {"epoch": 3}}
    dcp_safe.save(state, checkpoint_id=NAME, storage_writer=writer)
    writer.replication(NAME).result(timeout=60)
    writer.close(timeout_s=60)
    return node, memory_root


def _load(node: Path, remote: str, **kwargs: Any) -> NodeCacheStats:
    target = {**_zeros(), "meta": {"epoch": -1}}
    reader = SafeStorageReader(remote, node_cache=node, **kwargs)
    dcp_safe.load(target, checkpoint_id=NAME, storage_reader=reader)
    expected = _full_state(1)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"])
    assert target["meta"] == {"epoch": 3}
    return reader.stats()


def _only_rejection(stats: NodeCacheStats) -> CacheRejection:
    [rejection] = stats.rejections
    return rejection


SHARD = layout.shard_file_name(0, 0)


def test_an_intact_cache_serves_every_item(saved: tuple[Path, str]) -> None:
    stats = _load(*saved)
    assert (stats.files_from_cache, stats.files_from_remote, stats.rejections) == (1, 0, ())


@pytest.mark.parametrize("fqn", ["w", "meta.epoch"])
def test_a_corrupt_item_is_read_from_the_remote_even_with_verify_off(
    saved: tuple[Path, str], fqn: str, caplog: pytest.LogCaptureFixture
) -> None:
    node, remote = saved
    _flip_item_byte(node / NAME, SHARD, fqn)
    with caplog.at_level(logging.WARNING, logger="dcp_safe.reading.sources"):
        stats = _load(node, remote, verify=False)
    assert (stats.files_from_cache, stats.files_from_remote) == (0, 1)
    assert _only_rejection(stats).reason is RejectionReason.CHECKSUM
    assert "checksum mismatch" in caplog.text and SHARD in caplog.text


def test_a_cached_file_of_the_wrong_size_or_missing_is_read_from_the_remote(
    saved: tuple[Path, str],
) -> None:
    node, remote = saved
    shard = node / NAME / SHARD
    shard.write_bytes(shard.read_bytes() + b"\0")
    rejection = _only_rejection(_load(node, remote))
    assert (rejection.file, rejection.reason) == (SHARD, RejectionReason.SIZE)
    shard.unlink()
    rejection = _only_rejection(_load(node, remote))
    assert (rejection.file, rejection.reason) == (SHARD, RejectionReason.MISSING)


def test_a_tampered_or_absent_cache_is_ignored_entirely(saved: tuple[Path, str]) -> None:
    node, remote = saved
    _rewrite_cache_manifest(node / NAME, save_id="tampered", update_marker=False)
    stats = _load(node, remote)
    assert (stats.cache_path, stats.files_from_cache, stats.files_from_remote) == (None, 0, 1)
    assert _only_rejection(stats).reason is RejectionReason.BAD_MARKER

    (node / NAME / NODE_COMMITTED_MARKER).unlink()
    assert _only_rejection(_load(node, remote)).reason is RejectionReason.NO_CACHE
    assert _only_rejection(_load(node.parent / "elsewhere", remote)).reason is (
        RejectionReason.NO_CACHE
    )


def test_the_checkpoint_is_resolved_on_the_remote_only(saved: tuple[Path, str]) -> None:
    node, remote = saved
    with pytest.raises(CheckpointNotFoundError):
        SafeStorageReader(remote, node_cache=node).reset("step_2")
    # A cache is never a checkpoint: the cache root as the remote finds nothing to load.
    with pytest.raises(CheckpointNotFoundError):
        SafeStorageReader(node, node_cache=node).reset("latest")


def test_the_sources_are_read_in_order_and_peers_need_a_node_cache(tmp_path: Path) -> None:
    assert [s.kind for s in SafeStorageReader(tmp_path).sources] == [ReadSource.REMOTE]
    cached = SafeStorageReader(tmp_path, node_cache=tmp_path / "node", peers=True)
    assert [s.kind for s in cached.sources] == list(ReadSource)  # node cache, peer, remote
    with pytest.raises(ConfigError, match="node_cache"):
        SafeStorageReader(tmp_path, peers=True)
