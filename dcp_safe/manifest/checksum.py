"""Streaming checksums, named ``"<algorithm>:<hex digest>"`` so a manifest says how to check it.

Default xxh3-128 (~15 GB/s: about 7% beside a durable write, and overlapped with it); sha256 and
crc32 selectable; BLAKE3 for signed checkpoints (0.6x sha256's CPU time, and it spreads a large
update over every core). Measurements and the alternatives: docs/integrity.md, "Why xxh3-128".
Every algorithm here releases the GIL on large updates, which the hash-beside-I/O overlap needs.
"""

from __future__ import annotations

import enum
import hashlib
import os
import zlib
from collections.abc import Callable
from typing import Protocol

import blake3
import xxhash


class ChecksumAlgorithm(str, enum.Enum):
    """Supported checksum algorithms."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"
    BLAKE3 = "blake3"
    CRC32 = "crc32"


# Threads one BLAKE3 update may use: every core (the package's pool; a signed page-cache load
# took 1.52x unsigned with it, 2x on one thread). A pooled hasher pays on every update, however
# small (~220 us against ~38 us for a 32 KiB item), so only items known to be large use it.
BLAKE3_MAX_THREADS: int = blake3.blake3.AUTO
# Items from this size up hash on the pool (when the caller says how large the item is).
BLAKE3_PARALLEL_MIN_BYTES = 4 << 20


# Rust's rayon pool does not survive ``fork``: a child of a process that used it waits forever
# for workers that were not copied, so such children hash on the calling thread.
_pool_used = _forked_after_use = False


def _blake3_threads() -> int:
    global _pool_used
    _pool_used = _pool_used or BLAKE3_MAX_THREADS != 1
    return 1 if _forked_after_use else BLAKE3_MAX_THREADS


def _after_fork_in_child() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _pool_used


os.register_at_fork(after_in_child=_after_fork_in_child)


class Hasher(Protocol):
    """The part of hashlib's interface dcp_safe uses."""

    # ``object``: blake3's update returns the hasher itself, hashlib's and xxhash's None.
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib.crc32 behind hashlib's interface."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_HASHERS: dict[ChecksumAlgorithm, Callable[[], Hasher]] = {
    ChecksumAlgorithm.XXH3_128: xxhash.xxh3_128,
    ChecksumAlgorithm.SHA256: hashlib.sha256,
    ChecksumAlgorithm.CRC32: _Crc32,
}


def new_hasher(algorithm: ChecksumAlgorithm | str, *, size_hint: int | None = None) -> Hasher:
    """A fresh streaming hasher for ``algorithm``.

    ``size_hint``: how many bytes it will hash, if known; BLAKE3 spreads an item over every
    core only from ``BLAKE3_PARALLEL_MIN_BYTES`` up (``None``: unknown, assumed large).
    """
    algo = ChecksumAlgorithm(algorithm)
    if algo is ChecksumAlgorithm.BLAKE3:
        small = size_hint is not None and size_hint < BLAKE3_PARALLEL_MIN_BYTES
        return blake3.blake3(max_threads=1 if small else _blake3_threads())
    return _HASHERS[algo]()


def format_checksum(algorithm: ChecksumAlgorithm | str, hasher: Hasher) -> str:
    """The manifest form of a finished hasher."""
    return f"{ChecksumAlgorithm(algorithm).value}:{hasher.hexdigest()}"


def digest_bytes(data: bytes | bytearray | memoryview, algorithm: ChecksumAlgorithm | str) -> str:
    """Checksum of a whole buffer, in manifest form."""
    hasher = new_hasher(algorithm, size_hint=len(data))
    hasher.update(data)
    return format_checksum(algorithm, hasher)


def parse_checksum(checksum: str) -> tuple[ChecksumAlgorithm, str]:
    """Split ``"<algorithm>:<hex>"``; raises ValueError on an unknown algorithm."""
    algorithm, _, hexdigest = checksum.partition(":")
    return ChecksumAlgorithm(algorithm), hexdigest
