"""Streams that checksum bytes on their way to and from storage.

Writes: :class:`HashingSink` sits between DCP's serialization (``torch.save``, zstd) and the
backend's file; every byte that reaches the file is counted and hashed into the current item's
checksum, so an item is never buffered whole. Large writes are hashed on a helper thread while
the same bytes are written (both xxhash and hashlib release the GIL), so a slow hash such as
sha256 costs max(hash, write) rather than their sum.

Reads: :func:`read_verified` reads one item's byte range and checks it before anything is
deserialized.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.checksum import (
    ChecksumAlgorithm,
    Hasher,
    digest_bytes,
    format_checksum,
    new_hasher,
)
from dcp_safe.storage.backend import WritableFile

__all__ = ["HashingSink", "read_verified"]

# Below this, handing a write to another thread costs more than hashing it inline.
_OVERLAP_MIN_BYTES = 1 << 20
# Chunks small enough that hashing one overlaps writing the previous one.
_CHUNK_BYTES = 32 << 20


class HashingSink(io.RawIOBase):
    """A write-only stream that forwards to ``target`` and checksums each item.

    Not thread-safe: one sink per file, used by one writer thread.
    """

    def __init__(
        self,
        target: WritableFile,
        algorithm: ChecksumAlgorithm,
        hash_pool: ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__()
        self._target = target
        self._algorithm = algorithm
        self._pool = hash_pool
        self._hasher: Hasher = new_hasher(algorithm)
        self._position = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        if self._pool is None or view.nbytes < _OVERLAP_MIN_BYTES:
            self._hasher.update(view)
            self._target.write(view)
        else:
            for start in range(0, view.nbytes, _CHUNK_BYTES):
                chunk = view[start : start + _CHUNK_BYTES]
                hashed = self._pool.submit(self._hasher.update, chunk)
                self._target.write(chunk)
                hashed.result()
        self._position += view.nbytes
        return view.nbytes

    def close(self) -> None:
        # Serializers (torch.save, zstd writers) close what they are given; the file belongs
        # to the backend, so closing the sink must not close it.
        pass

    def take_checksum(self) -> str:
        """The checksum of everything written since the last call; starts the next item."""
        checksum = format_checksum(self._algorithm, self._hasher)
        self._hasher = new_hasher(self._algorithm)
        return checksum


def read_verified(
    stream: BinaryIO, *, path: str, item: str | None, start: int, length: int, checksum: str | None
) -> bytes:
    """Read ``length`` bytes at ``start`` and check them against ``checksum`` (if given).

    Raises:
        CheckpointCorruptError: short read (a truncated file) or checksum mismatch.
    """
    stream.seek(start)
    data = stream.read(length)
    if len(data) != length:
        raise CheckpointCorruptError(
            path,
            "file is shorter than the manifest says",
            item=item,
            expected=length,
            actual=len(data),
        )
    if checksum is not None:
        algorithm = ChecksumAlgorithm(checksum.partition(":")[0])
        actual = digest_bytes(data, algorithm)
        if actual != checksum:
            raise CheckpointCorruptError(
                path, "checksum mismatch", item=item, expected=checksum, actual=actual
            )
    return data
