"""The signature check of a committed checkpoint, for readers that hold a signing key.

:func:`check_signed` checks the HMAC in ``_SIGNATURE`` against the digest of the very bytes the
opened manifest was parsed from (nothing swapped in after the open counts, nothing parsed twice)
and requires every checksum in it to be cryptographic; item checks then authenticate every byte
a load uses. Threat model: docs/integrity.md, "Signed checkpoints".
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.committed import CommittedCheckpoint
from dcp_safe.errors import CheckpointCorruptError, SignatureError, UnsignedCheckpointError
from dcp_safe.manifest.signing import MAX_SIGNATURE_BYTES, check_signature, is_cryptographic

__all__ = ["check_signed", "signed_by"]


def check_signed(backend: Backend, opened: CommittedCheckpoint, key: bytes) -> None:
    """Raise unless the manifest of ``opened`` (from :func:`open_committed` on ``backend``) is
    signed with ``key``.

    Raises:
        UnsignedCheckpointError: no ``_SIGNATURE``.
        SignatureError: a signature from another key, or over another manifest, or over one
            with a checksum that is not cryptographic.
    """
    name, manifest = opened.name, opened.manifest
    manifest_path = backend.full_path(f"{name}/{layout.MANIFEST}")
    signature = _read_signature(backend, name)
    check_signature(key, opened.digest, signature, manifest_path)
    weak = [
        checksum
        for checksum in [f.checksum for f in manifest.files] + [i.checksum for i in manifest.items]
        if checksum is not None and not is_cryptographic(checksum)
    ]
    if weak or not is_cryptographic(manifest.checksum_algorithm + ":"):
        shown = weak[0] if weak else manifest.checksum_algorithm
        raise SignatureError(manifest_path, f"signed over a non-cryptographic checksum ({shown})")


def _read_signature(backend: Backend, name: str) -> bytes:
    rel = f"{name}/{layout.SIGNATURE}"
    try:
        # Stat first: a FIFO or an endless device under this name is refused, not waited on.
        return backend.read_small(rel, MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        raise UnsignedCheckpointError(
            backend.full_path(name), f"the checkpoint has no {layout.SIGNATURE}"
        ) from None
    except CheckpointCorruptError as exc:  # not a regular file, or too large
        raise SignatureError(backend.full_path(rel), f"unusable signature file: {exc}") from None


def signed_by(key: bytes) -> Callable[[Backend, CommittedCheckpoint], None]:
    """A check for listings: raise unless a committed checkpoint is signed with ``key``.

    With a key, only such checkpoints count (``latest``, listings, retention): an unsigned one
    is skipped like a damaged one, so nobody who can write the root can push a signed one out.

    Raises (from the check):
        SignatureError, UnsignedCheckpointError: it is not signed with ``key``.
    """

    def check(backend: Backend, opened: CommittedCheckpoint) -> None:
        check_signed(backend, opened, key)

    return check
