"""Byte stores: a small protocol over local files, fsspec and S3, with capabilities and retries.

This layer knows nothing of checkpoints; its modules are listed in docs/architecture.md,
"Layers".
"""
