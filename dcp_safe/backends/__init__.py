"""Byte stores: a small protocol over local files, fsspec and S3, with capabilities and retries.

``backend`` defines :class:`~dcp_safe.backends.backend.Backend` (the byte protocol every higher
layer uses, and the capability flags it chooses strategies by); ``local_backend`` and
``fsspec_backend`` implement it; ``retry``/``retrying_backend`` bound every operation by
attempts and a deadline; ``roots`` picks the backend for a root URL; ``s3_upload`` and
``multipart`` are S3's streaming uploads and their cleanup. This layer knows nothing of
checkpoints: only :mod:`dcp_safe.errors` sits below it.
"""
