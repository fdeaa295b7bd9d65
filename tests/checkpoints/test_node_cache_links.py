"""A node cache is read beneath its own root too: no link in it leads a load or a prune outside.

The node-local root is storage like any other: whoever can write it can plant a link as a
shard, as a whole cache, or a cache under a name with terminal escapes. A node cache is built
here as ``NodeLocalWriter`` leaves one (the committed checkpoint's files, ``_NODE_COMMITTED``
holding its manifest's digest), next to a sentinel tree that inotify watches.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from inotify_watch import TreeWatch
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions, layout
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.node_cache import (
    NODE_COMMITTED_MARKER,
    list_node_caches,
    prune_node_caches,
)
from dcp_safe.reading.sources import ReadSource, RejectionReason

NAME = "step_0001"
SHARD = layout.shard_file_name(0, 0)
_ACTIVE = re.compile("[\x00-\x1f\x7f-\x9f]")


def _cache(remote: Path, node: Path, name: str) -> Path:
    """A node cache of ``remote``'s checkpoint ``NAME`` at ``node/name``."""
    folder = node / name
    shutil.copytree(remote / NAME, folder)
    marker = (folder / layout.COMMITTED_MARKER).read_bytes()
    (folder / layout.COMMITTED_MARKER).unlink()
    (folder / NODE_COMMITTED_MARKER).write_bytes(marker)
    return folder


def test_links_in_a_node_root_are_never_followed(tmp_path: Path, caplog: Any) -> None:
    remote, node, outside = tmp_path / "remote", tmp_path / "node", tmp_path / "outside"
    writer = SafeStorageWriter(remote, options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(make_state(1), checkpoint_id=NAME, storage_writer=writer)
    node.mkdir()
    cache = _cache(remote, node, NAME)
    # The cache's shard, moved outside (it would even pass its checksums) and linked back.
    outside.mkdir()
    shutil.move(cache / SHARD, outside / SHARD)
    (cache / SHARD).symlink_to(outside / SHARD)
    # A whole cache outside, linked in under a name; another under a name with escapes.
    _cache(remote, outside, "step_0002")
    (node / "step_0002").symlink_to(outside / "step_0002", target_is_directory=True)
    _cache(remote, node, "evil\x1b]0;pwned\x07")

    watch = TreeWatch()
    watch.add_tree(outside)
    try:
        target = blank_like(make_state(1))
        reader = SafeStorageReader(remote, node_cache=node)
        dcp_safe.load(target, checkpoint_id=NAME, storage_reader=reader)
        with caplog.at_level(logging.WARNING, logger="dcp_safe"):
            listed = [c.name for c in list_node_caches(node)]
            removed = prune_node_caches(open_backend(str(node)), keep=0)
        touched = watch.events()
    finally:
        watch.close()
    assert touched == []
    assert_state_equal(target, make_state(1))
    assert SHARD in {r.file for r in reader.stats().rejections}  # read from the remote
    assert listed == [NAME] and removed == [NAME]
    assert (node / "step_0002").is_symlink() and (outside / "step_0002").is_dir()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("dcp_safe")]
    assert not [m for m in messages if _ACTIVE.search(m)]
    assert any("evil\\x1b]0;pwned\\x07" in m for m in messages)


def test_a_linked_peers_folder_is_passed_by_and_the_load_reads_the_remote(
    tmp_path: Path, caplog: Any
) -> None:
    """A ``.peers`` planted as a link on the node disk: the restore neither follows it nor
    fails on it (was: every peer-tier restore raised ``CheckpointCorruptError``)."""
    remote, node, outside = tmp_path / "remote", tmp_path / "node", tmp_path / "outside"
    writer = SafeStorageWriter(remote, options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(make_state(1), checkpoint_id=NAME, storage_writer=writer)
    node.mkdir()
    outside.mkdir()
    (node / layout.PEERS_DIR).symlink_to(outside, target_is_directory=True)
    watch = TreeWatch()
    watch.add_tree(outside)
    try:
        target = blank_like(make_state(1))
        reader = SafeStorageReader(remote, node_cache=node, peers=True)
        with caplog.at_level(logging.WARNING, logger="dcp_safe"):
            dcp_safe.load(target, checkpoint_id=NAME, storage_reader=reader)
        touched = watch.events()
    finally:
        watch.close()
    assert touched == [] and list(outside.iterdir()) == []
    assert_state_equal(target, make_state(1))
    [passed] = [r for r in reader.stats().rejections if r.source is ReadSource.PEER]
    assert passed.reason is RejectionReason.UNREADABLE and "symbolic link" in passed.detail
    assert any("symbolic link" in r.getMessage() for r in caplog.records)
