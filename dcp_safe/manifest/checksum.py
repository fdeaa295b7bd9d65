"""Streaming checksums, named ``"<algorithm>:<hex digest>"`` so a manifest says how to check it.

Default: xxh3-128. Measured over 256 MiB in memory on this project's 2-core machine (table and
command in docs/integrity.md): xxh3-128 ~15-17 GB/s, crc32c ~13 GB/s, zlib crc32 ~2.4 GB/s,
sha256 ~1.55 GB/s. Against a durable local write (~1.1 GB/s there) xxh3 adds ~7% when run
serially, and the writer overlaps it with the write; sha256 would add ~70%, so it is offered for
those who need a cryptographic digest, not chosen by default. crc32c would need another
dependency and is no faster than xxh3, so it is not offered.

Cryptographic: BLAKE3 (the official ``blake3`` package: Rust, SIMD) is what signed checkpoints
use; sha256 is still read and selectable. Measured as CPU time on one core over 256 MiB in
16 MiB updates (robust to this shared machine's load; command in docs/integrity.md): BLAKE3
2.1-2.3 GB/s, sha256 1.4 GB/s (with SHA-NI), xxh3-128 7.4-9 GB/s; and BLAKE3, a tree hash,
spreads one large update over every core (``BLAKE3_MAX_THREADS``). Like hashlib and xxhash,
blake3 releases the GIL on large updates, which the hash-beside-read/write overlap depends on.
"""

from __future__ import annotations

import enum
import hashlib
import os
import zlib
from typing import Protocol

import blake3
import xxhash

__all__ = [
    "BLAKE3_MAX_THREADS",
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
    BLAKE3 = "blake3"
    CRC32 = "crc32"


# Threads one BLAKE3 update may use: every core (``AUTO``, the package's shared pool). A load
# from the page cache is bound by the hash: 256 MiB signed loaded at 1.04x-2.11x unsigned with
# it (median 1.52x), 1.87x-2.41x on one thread (benchmarks/bench_signing.py, docs/integrity.md).
# The price: a large save or load briefly takes every core; and a hasher on the pool pays for
# it on every update, however small (an item of 32 KiB between two ~700-byte records: ~220 us
# against ~38 us on one thread here), so only hashes of items known to be large use it.
BLAKE3_MAX_THREADS: int = blake3.blake3.AUTO
# Items from this size up hash on the pool (when the caller says how large the item is).
BLAKE3_PARALLEL_MIN_BYTES = 4 << 20


class _Blake3Pool:
    """Whether this process may hand BLAKE3 work to the package's thread pool.

    That pool (Rust's rayon) is started once per process and does not survive ``fork``: a
    child of a process that used it waits forever for workers that were not copied (measured:
    a forked child's first multi-threaded update hung). So once a process has used the pool,
    its forked children hash on the calling thread.
    """

    used = False
    forked_after_use = False

    @classmethod
    def threads(cls) -> int:
        if cls.forked_after_use:
            return 1
        if BLAKE3_MAX_THREADS != 1:
            cls.used = True
        return BLAKE3_MAX_THREADS

    @classmethod
    def after_fork_in_child(cls) -> None:
        cls.forked_after_use = cls.forked_after_use or cls.used


os.register_at_fork(after_in_child=_Blake3Pool.after_fork_in_child)


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


def new_hasher(algorithm: ChecksumAlgorithm | str, *, size_hint: int | None = None) -> Hasher:
    """A fresh streaming hasher for ``algorithm``.

    ``size_hint``: how many bytes it will hash, if known; BLAKE3 spreads an item over every
    core only from ``BLAKE3_PARALLEL_MIN_BYTES`` up (``None``: unknown, assumed large).
    """
    algo = ChecksumAlgorithm(algorithm)
    if algo is ChecksumAlgorithm.XXH3_128:
        hasher: Hasher = xxhash.xxh3_128()
        return hasher
    if algo is ChecksumAlgorithm.SHA256:
        return hashlib.sha256()
    if algo is ChecksumAlgorithm.BLAKE3:
        small = size_hint is not None and size_hint < BLAKE3_PARALLEL_MIN_BYTES
        return blake3.blake3(max_threads=1 if small else _Blake3Pool.threads())
    return _Crc32()


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
