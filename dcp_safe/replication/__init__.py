"""Background replication of committed checkpoints to a second root (the S3 tier).

:mod:`dcp_safe.replication.replicator` copies a committed local checkpoint's files, checking
every item's checksum as the bytes stream, and repeats the commit protocol on the remote root.
"""
