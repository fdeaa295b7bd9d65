"""The DCP adapters: what ``torch.distributed.checkpoint`` calls.

``writer`` (:class:`SafeStorageWriter`) and ``reader`` (:class:`SafeStorageReader`) implement
DCP's storage interfaces over :mod:`dcp_safe.backends`, publishing through :mod:`dcp_safe.commit`;
``node_local`` is the node-local writer (each node's own root, then the shared remote) and
``node_cache_reader`` its reader (the remote checkpoint, with files read from the node cache);
``options`` holds the writer's options; ``api`` wraps ``dcp.save``/``async_save``/``load`` with
deadlines and dcp_safe's errors, on the dedicated process group of ``group``.
"""
