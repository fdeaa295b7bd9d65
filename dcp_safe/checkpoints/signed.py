"""The signature check of a committed checkpoint, for readers that hold a signing key.

:func:`open_committed` proves that the marker and the manifest agree, which anyone who can write
the root can arrange. With a key, :func:`check_signed` also proves that the manifest is one the
key signed (:mod:`dcp_safe.manifest.signing`): it reads ``manifest.json`` again, checks the HMAC
in ``_SIGNATURE`` against that exact content, requires it to be the manifest already opened
(so nothing swapped in between counts), and requires every checksum in it to be cryptographic.
After that, checking items against the manifest as usual authenticates every byte a load uses.
"""

from __future__ import annotations

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.errors import CheckpointCorruptError, SignatureError, UnsignedCheckpointError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest, manifest_digest
from dcp_safe.manifest.signing import MAX_SIGNATURE_BYTES, check_signature, is_cryptographic

__all__ = ["check_signed"]


def check_signed(backend: Backend, name: str, manifest: Manifest, key: bytes) -> None:
    """Raise unless ``manifest`` (opened from ``name``) is signed with ``key``.

    Raises:
        UnsignedCheckpointError: no ``_SIGNATURE``.
        SignatureError: a signature from another key, or over another manifest.
        CheckpointCorruptError: the manifest changed since it was opened, or one of its
            checksums is not cryptographic.
    """
    manifest_path = backend.full_path(f"{name}/{layout.MANIFEST}")
    signature = _read_signature(backend, name)
    raw = backend.read_small(f"{name}/{layout.MANIFEST}", MANIFEST_MAX_BYTES)
    check_signature(key, manifest_digest(raw), signature, manifest_path)
    if Manifest.from_json(raw, manifest_path) != manifest:
        raise CheckpointCorruptError(manifest_path, "manifest changed while being opened")
    weak = [
        checksum
        for checksum in _checksums(manifest)
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


def _checksums(manifest: Manifest) -> list[str | None]:
    return [f.checksum for f in manifest.files] + [i.checksum for i in manifest.items]
