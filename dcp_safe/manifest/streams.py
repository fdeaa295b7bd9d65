"""Streams that checksum bytes on their way to and from storage.

Writes: :class:`HashingSink` hashes every byte that reaches the file into the current item's
checksum, so an item is never buffered whole; large writes are hashed on a helper thread while
the same bytes are written, so a slow hash costs max(hash, write). Reads: :func:`read_verified`
checks an item's byte range before anything is deserialized.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest.blocks import BlockDigests, BlockHasher
from dcp_safe.manifest.checksum import (
    ChecksumAlgorithm,
    Hasher,
    digest_bytes,
    format_checksum,
    new_hasher,
)


class WritableFile(Protocol):
    """The file object a backend hands out for streaming writes (what a sink writes to)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int | None: ...

    def tell(self) -> int: ...


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
        self._hasher: Hasher | None = None  # made by expect() or at the item's first write
        self._blocks: BlockHasher | None = None
        self._position = 0

    def expect(self, size_hint: int) -> None:
        """Say about how many bytes the next item holds (BLAKE3 spreads only large items over
        every core; a small one would pay for the hand-off on each write). Called before the
        item's first byte is written."""
        self._hasher = new_hasher(self._algorithm, size_hint=size_hint)

    def hash_blocks(self, *, at: int, length: int, block_bytes: int) -> None:
        """Also digest ``[at, at + length)`` of the next item (from its start) block by block,
        in the same pass (:mod:`dcp_safe.manifest.blocks`); :meth:`take_blocks` returns them.
        Called before the item's first byte is written."""
        self._blocks = BlockHasher(self._algorithm, self._position, at, length, block_bytes)

    def _current(self) -> Hasher:
        if self._hasher is None:
            self._hasher = new_hasher(self._algorithm)
        return self._hasher

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        hasher = self._current()
        if self._pool is None or view.nbytes < _OVERLAP_MIN_BYTES:
            hasher.update(view)
            if self._blocks is not None:
                self._blocks.update(self._position, view)
            self._target.write(view)
        else:
            blocks = self._blocks
            for start in range(0, view.nbytes, _CHUNK_BYTES):
                chunk = view[start : start + _CHUNK_BYTES]
                # Two tasks: with a second free helper the block digests cost no extra time.
                hashed = [self._pool.submit(hasher.update, chunk)]
                if blocks is not None:
                    hashed.append(self._pool.submit(blocks.update, self._position + start, chunk))
                self._target.write(chunk)
                for done in hashed:
                    done.result()
        self._position += view.nbytes
        return view.nbytes

    def close(self) -> None:
        # Serializers (torch.save, zstd writers) close what they are given; the file belongs
        # to the backend, so closing the sink must not close it.
        pass

    def take_checksum(self) -> str:
        """The checksum of everything written since the last call; starts the next item."""
        checksum = format_checksum(self._algorithm, self._current())
        self._hasher = None
        return checksum

    def take_blocks(self) -> BlockDigests | None:
        """The block digests :meth:`hash_blocks` asked for since the last call (``None``: not
        asked); starts the next item."""
        blocks, self._blocks = self._blocks, None
        return None if blocks is None else blocks.result()


def read_fully(stream: Any, view: memoryview) -> int:
    """Fill ``view`` from ``stream``'s position on (a read may return less than asked); the
    bytes read, fewer only at the end of the file. ``stream``: anything with ``readinto``."""
    total = 0
    while total < view.nbytes and (got := stream.readinto(view[total:])):
        total += got
    return total


def short_read(path: str, item: str | None, expected: int, actual: int) -> CheckpointCorruptError:
    """The error for an item whose file ends before the manifest says it does."""
    return CheckpointCorruptError(
        path, "file is shorter than the manifest says", item=item, expected=expected, actual=actual
    )


def check_digest(
    path: str, item: str | None, expected: str, actual: str | Hasher, *, block: int | None = None
) -> None:
    """Raise unless ``actual`` (a checksum, or a hasher of ``expected``'s algorithm that has
    seen every byte) is ``expected``: the whole item's, or block ``block`` of its data's."""
    if not isinstance(actual, str):
        actual = format_checksum(expected.partition(":")[0], actual)
    if actual != expected:
        where = "" if block is None else f" in block {block} of the tensor data"
        raise CheckpointCorruptError(
            path, f"checksum mismatch{where}", item=item, expected=expected, actual=actual
        )


def read_verified(
    stream: BinaryIO, path: str, item: str | None, start: int, length: int, checksum: str | None
) -> bytearray:
    """Read ``length`` bytes at ``start`` into a ``bytearray`` (decoded tensors may share its
    memory) and check them against ``checksum`` (if given).

    Raises:
        CheckpointCorruptError: short read (a truncated file) or checksum mismatch.
    """
    data = bytearray(length)
    stream.seek(start)
    got = read_fully(stream, memoryview(data))
    if got != length:
        raise short_read(path, item, length, got)
    if checksum is not None:
        check_digest(path, item, checksum, digest_bytes(data, checksum.partition(":")[0]))
    return data
