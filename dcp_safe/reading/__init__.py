"""Reading a checkpoint back: one reader's sources (this node's cache, a peer copy, the remote),
ranges and blocks of a stored tensor, read-once planning, the load budget and the restore audit.

``SafeStorageReader`` (:mod:`dcp_safe.adapters.reader`) is the adapter DCP calls; what it reads
with lives here. Each module's job: docs/architecture.md, "Layers".
"""
