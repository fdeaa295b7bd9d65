"""The writer of a :class:`~dcp_safe.topology.Topology`: the one place a topology's roles become
writer arguments (the manager and a user of the writer both build their writer here)."""

from __future__ import annotations

from typing import Any

from dcp_safe.adapters.node_local import NodeLocalOptions, NodeLocalWriter
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.replication.rank_upload import UploadOptions
from dcp_safe.topology import Topology

__all__ = ["writer_for"]


def writer_for(
    topology: Topology, *, remote_timeout_s: float | None = None, **kwargs: Any
) -> SafeStorageWriter:
    """A :class:`SafeStorageWriter` of ``topology``'s commit root (and its replica), or, with a
    node cache, a :class:`NodeLocalWriter` that writes there and uploads to the commit root.
    The writer keeps ``topology`` itself as its ``topology``.

    Args:
        remote_timeout_s: bounds the per-rank uploads' waits (rank 0 for every rank's upload,
            a rank for the remote commit: twice it); default: the upload options' own.
        **kwargs: the other :class:`SafeStorageWriter` arguments (``attempt``, ``options``,
            ...); not the roots, which the topology gives.
    """
    bound: dict[str, Any] = (
        {} if remote_timeout_s is None else {"remote_timeout_s": remote_timeout_s}
    )
    if topology.node_cache is None:
        return SafeStorageWriter(topology, replication_options=UploadOptions(**bound), **kwargs)
    return NodeLocalWriter(topology, node_options=NodeLocalOptions(**bound), **kwargs)
