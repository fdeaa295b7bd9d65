"""Signed checkpoints: the key, the signature over a manifest digest, and its check.

``_SIGNATURE`` beside ``manifest.json`` holds ``hmac-sha256:<hex>``, an HMAC under the signing
key of the digest ``_COMMITTED`` holds; with every item's checksum cryptographic (BLAKE3 by
default), it covers every byte a load uses. Pure: the reads are
:mod:`dcp_safe.checkpoints.committed`'s and the committer's. Key rules, threat model and costs:
docs/integrity.md, "Signed checkpoints".

An HMAC, not a public-key signature: writer and reader are one party (a job and its restarts),
and ``hmac`` needs no dependency. A file beside the marker, not inside it, so readers without a
key, replication and marker tools stay as they were; it is written before the marker.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from dcp_safe.choices import parse_choice
from dcp_safe.errors import ConfigError, SignatureError
from dcp_safe.manifest.checksum import ChecksumAlgorithm

SIGNING_KEY_ENV = "DCP_SAFE_SIGNING_KEY"
SIGNATURE_ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
# A signature is one short line; nobody reads or copies more than this of a ``_SIGNATURE``.
MAX_SIGNATURE_BYTES = 1024
# Item checksums a signature can vouch for: finding other bytes with the same digest is
# infeasible. xxh3 and crc32 catch accidents only: anyone can craft a colliding item.
CRYPTOGRAPHIC_CHECKSUMS = frozenset({ChecksumAlgorithm.BLAKE3, ChecksumAlgorithm.SHA256})
# What a signed save hashes its items with unless told otherwise.
SIGNED_DEFAULT_CHECKSUM = ChecksumAlgorithm.BLAKE3
# Domain separation: this HMAC signs a dcp_safe manifest digest and nothing else.
_CONTEXT = b"dcp_safe signed manifest v1\n"
_HEX_PREFIX = "hex:"
# What a rank's part of a save without collectives is authenticated under: a key derived from
# the signing key, so that no such MAC ever passes for a manifest signature, or one for it.
_PART_LABEL = b"dcp_safe rank part v1"


def resolve_key(
    key: bytes | bytearray | str | None, *, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The signing key to use: ``key``, else ``DCP_SAFE_SIGNING_KEY``, else ``None``.

    Bytes are used as they are; a str as its UTF-8 bytes, or ``"hex:<digits>"`` decoded (the
    variable's value likewise, read from ``environ``, default ``os.environ``).

    Raises:
        ConfigError: a key shorter than ``MIN_KEY_BYTES``, bad hex, or not bytes or str.
    """
    source = "signing_key"
    if key is None:
        key = (os.environ if environ is None else environ).get(SIGNING_KEY_ENV)
        if not key:
            return None
        source = f"${SIGNING_KEY_ENV}"
    if isinstance(key, str) and key.startswith(_HEX_PREFIX):
        try:
            key = bytes.fromhex(key[len(_HEX_PREFIX) :])
        except ValueError:
            raise ConfigError(f"{source} starts with 'hex:' but is not hex digits") from None
    elif isinstance(key, str):
        key = key.encode("utf-8")
    elif not isinstance(key, bytes | bytearray):
        raise ConfigError(f"signing_key must be bytes or str, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{source} is {len(key)} bytes; a signing key needs at least {MIN_KEY_BYTES}"
            " (e.g. 'hex:' + 64 hex digits from `python -c 'import secrets;"
            " print(secrets.token_hex(32))'`)"
        )
    return bytes(key)


def sign_digest(key: bytes, digest: str) -> bytes:
    """The contents of ``_SIGNATURE`` for a manifest whose digest is ``digest``."""
    mac = hmac.new(key, _CONTEXT + digest.encode("ascii"), hashlib.sha256).hexdigest()
    return f"{SIGNATURE_ALGORITHM}:{mac}\n".encode("ascii")


def check_signature(key: bytes, digest: str, signature: bytes, path: str) -> None:
    """Raise unless ``signature`` (``_SIGNATURE``'s bytes) signs ``digest`` under ``key``.

    Raises:
        SignatureError: a malformed signature, another algorithm, or another key or manifest.
    """
    expected = sign_digest(key, digest).strip()
    if not hmac.compare_digest(signature.strip(), expected):
        algorithm = signature.partition(b":")[0][:32].decode("ascii", errors="replace")
        reason = (
            "the signature does not match the manifest"
            if algorithm == SIGNATURE_ALGORITHM
            else f"the signature is not {SIGNATURE_ALGORITHM} (found {algorithm!r})"
        )
        raise SignatureError(path, reason)


def part_mac(key: bytes, save: str, rank: int, body: Mapping[str, Any]) -> str:
    """The HMAC (hex) that authenticates ``body`` (JSON fields), what rank ``rank`` leaves on
    storage for its peers in save ``save`` (a save without collectives: a rank's report, rank
    0's assignment). It covers the fields as parsed, so a reader checks what it uses."""
    derived = hmac.new(key, _PART_LABEL, hashlib.sha256).digest()
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    message = f"{save}\n{rank}\n{canonical}".encode()
    return hmac.new(derived, message, hashlib.sha256).hexdigest()


def part_mac_matches(
    key: bytes, save: str, rank: int, body: Mapping[str, Any], mac: object
) -> bool:
    """Whether ``mac`` (as found on storage: anything) is :func:`part_mac` of ``body``."""
    expected = part_mac(key, save, rank, body).encode("ascii")
    return isinstance(mac, str) and hmac.compare_digest(mac.encode("utf-8", "replace"), expected)


def is_cryptographic(checksum: str) -> bool:
    """Whether a manifest checksum (``"<algorithm>:<hex>"``) uses a cryptographic hash."""
    return checksum.partition(":")[0] in {a.value for a in CRYPTOGRAPHIC_CHECKSUMS}


def checksum_for(choice: ChecksumAlgorithm | str | None, *, signed: bool) -> ChecksumAlgorithm:
    """The item checksum of a save: ``choice``, or by default BLAKE3 signed, xxh3-128 unsigned.

    Raises:
        ConfigError: a signed save asked for a checksum that is not cryptographic.
    """
    if choice is None:
        return SIGNED_DEFAULT_CHECKSUM if signed else ChecksumAlgorithm.XXH3_128
    algorithm = parse_choice(ChecksumAlgorithm, choice, "checksum")
    if signed and algorithm not in CRYPTOGRAPHIC_CHECKSUMS:
        raise ConfigError(
            f"checksum={algorithm.value!r} is not cryptographic, so a signature over it would"
            " prove nothing about the items; leave checksum unset (blake3) or choose sha256"
            " for a signed save"
        )
    return algorithm
