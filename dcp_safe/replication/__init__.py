"""Background replication of committed checkpoints to a second root (the S3 tier).

:mod:`~dcp_safe.replication.replicator` copies a committed local checkpoint's files on one
process; :mod:`~dcp_safe.replication.rank_replicator` has each rank of a multi-rank save upload
its own files (:mod:`~dcp_safe.replication.rank_upload`: the per-rank upload and its storage
markers, also used by ``NodeLocalWriter``). Both check every item's checksum as the bytes stream
(:mod:`~dcp_safe.replication.copying`) and publish on the remote root through the remote's
:class:`~dcp_safe.commit.replica.ReplicaPublication`.
"""
