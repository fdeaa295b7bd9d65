"""Streaming checksums, named ``"<algorithm>:<hex digest>"`` so a manifest says how to check it.

Default: xxh3-128. Measured over 256 MiB in memory on this project's 2-core machine (table and
command in docs/integrity.md): xxh3-128 ~15-17 GB/s, crc32c ~13 GB/s, zlib crc32 ~2.4 GB/s,
sha256 ~1.55 GB/s. Against a durable local write (~1.1 GB/s there) xxh3 adds ~7% when run
serially, and the writer overlaps it with the write; sha256 would add ~70%, so it is offered for
those who need a cryptographic digest, not chosen by default. crc32c would need another
dependency and is no faster than xxh3, so it is not offered.
"""

from __future__ import annotations

import enum
import hashlib
import zlib
from typing import Protocol

import xxhash

__all__ = [
    "ChecksumAlgorithm",
    "Hasher",
    "digest_bytes",
    "format_checksum",
    "new_hasher",
    "parse_checksum",
]


class ChecksumAlgorithm(str, enum.Enum):
    """Supported checksum algorithms."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"
    CRC32 = "crc32"


class Hasher(Protocol):
    """The part of hashlib's interface dcp_safe uses."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib.crc32 behind hashlib's interface."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(algorithm: ChecksumAlgorithm | str) -> Hasher:
    """A fresh streaming hasher for ``algorithm``."""
    algo = ChecksumAlgorithm(algorithm)
    if algo is ChecksumAlgorithm.XXH3_128:
        hasher: Hasher = xxhash.xxh3_128()
        return hasher
    if algo is ChecksumAlgorithm.SHA256:
        return hashlib.sha256()
    return _Crc32()


def format_checksum(algorithm: ChecksumAlgorithm | str, hasher: Hasher) -> str:
    """The manifest form of a finished hasher."""
    return f"{ChecksumAlgorithm(algorithm).value}:{hasher.hexdigest()}"


def digest_bytes(data: bytes | bytearray | memoryview, algorithm: ChecksumAlgorithm | str) -> str:
    """Checksum of a whole buffer, in manifest form."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return format_checksum(algorithm, hasher)


def parse_checksum(checksum: str) -> tuple[ChecksumAlgorithm, str]:
    """Split ``"<algorithm>:<hex>"``; raises ValueError on an unknown algorithm."""
    algorithm, _, hexdigest = checksum.partition(":")
    return ChecksumAlgorithm(algorithm), hexdigest
