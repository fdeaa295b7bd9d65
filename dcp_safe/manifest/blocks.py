"""Per-block digests of a large tensor item's raw data: what lets a load read part of an item.

A resharded load often needs only some rows of a stored chunk (a tensor saved over 2 ranks and
loaded over 4 needs half of each rank's chunk), but the item's one checksum can be checked only
over all its bytes. So the writer also hashes the item's tensor data, ``[at, at + length)`` of
its stored bytes, in blocks of ``block_bytes``, in the same pass as the item checksum, with the
same algorithm: a reader that needs a sub-range reads and checks only the blocks covering it.
``at`` and ``length`` record where the writer put the data; a reader never takes them on trust
(digests can be recomputed over any bytes of the item): it derives the data's place from the
tensor's stored template and refuses a record that disagrees (:mod:`dcp_safe.reading.tensors`).
The digests live in the item's manifest record, so ``_COMMITTED``'s digest (and a signature over
it) covers them as it covers the item checksums (docs/integrity.md, "Block digests").

Digests are stored bare (hex, no ``algorithm:`` prefix): the item checksum names the algorithm,
and a large checkpoint lists one digest per 4 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcp_safe.manifest.checksum import ChecksumAlgorithm, Hasher, new_hasher
from dcp_safe.manifest.limits import require_int, require_keys, require_list

#: The block size the writer uses: small enough that a reader rounds a range up by little,
#: large enough that the manifest grows by about 44 bytes per 4 MiB (0.001%).
BLOCK_BYTES = 4 << 20
#: Items whose tensor data is smaller than this get no block digests (read whole, they cost
#: at most two blocks more than a partial read would).
BLOCK_DIGEST_MIN_BYTES = 2 * BLOCK_BYTES
# Below this a block size is not meaningful (and would let a manifest list digests per byte).
_MIN_BLOCK_BYTES = 4096
_MAX_DIGEST_CHARS = 128
_HEX = frozenset("0123456789abcdef")
_KEYS = frozenset(("at", "bytes", "digests", "length"))


@dataclass(frozen=True, kw_only=True)
class BlockDigests:
    """The digests of ``[at, at + length)`` of an item's stored bytes, ``block_bytes`` each
    (the last block may be shorter)."""

    at: int
    length: int
    block_bytes: int
    digests: tuple[str, ...]

    def __post_init__(self) -> None:
        require_int("blocks.at", self.at)
        require_int("blocks.length", self.length, minimum=1)
        require_int("blocks.bytes", self.block_bytes, minimum=_MIN_BLOCK_BYTES)
        for digest in self.digests:
            if not (
                type(digest) is str
                and 0 < len(digest) <= _MAX_DIGEST_CHARS
                and _HEX.issuperset(digest)
            ):
                raise ValueError(f"block digest {str(digest)[:40]!r} is not lowercase hex")
        if len(self.digests) != -(-self.length // self.block_bytes):
            raise ValueError("blocks.digests does not hold one digest per block")

    def span(self, block: int) -> tuple[int, int]:
        """Where block ``block`` lies in the data: ``[begin, end)`` relative to ``at``."""
        begin = block * self.block_bytes
        return begin, min(begin + self.block_bytes, self.length)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object the item's manifest record holds."""
        return {
            "at": self.at,
            "bytes": self.block_bytes,
            "digests": self.digests,
            "length": self.length,
        }

    @classmethod
    def from_dict(cls, raw: object) -> BlockDigests:
        """Raises ValueError: not an object of exactly these fields, well typed."""
        raw = require_keys("blocks", raw, _KEYS)
        digests = tuple(require_list("blocks.digests", raw["digests"]))
        return cls(at=raw["at"], length=raw["length"], block_bytes=raw["bytes"], digests=digests)


class BlockHasher:
    """Hashes ``[at, at + length)`` of an item that starts at ``item_start`` of a file, in
    blocks, as the file's bytes go past.

    Bytes are fed with their position in the file, in order; bytes outside the range are
    ignored, so a writer or verifier can feed every byte of a file or item through it.
    """

    def __init__(
        self,
        algorithm: ChecksumAlgorithm | str,
        item_start: int,
        at: int,
        length: int,
        block_bytes: int,
    ) -> None:
        self._algorithm, self._at, self._length = ChecksumAlgorithm(algorithm), at, length
        self._start = self._done = item_start + at
        self._end, self._block_bytes = self._start + length, block_bytes
        self._hasher: Hasher | None = None
        self._digests: list[str] = []

    def update(self, position: int, data: memoryview) -> None:
        """Feed ``data``, which lies at ``position``; bytes before the range, or already fed, are
        skipped (the callers feed a file's bytes in order)."""
        lo, hi = max(position, self._done), min(position + data.nbytes, self._end)
        while lo < hi:
            block_end = lo + self._block_bytes - (lo - self._start) % self._block_bytes
            take = min(hi, block_end) - lo
            if self._hasher is None:
                self._hasher = new_hasher(self._algorithm, size_hint=self._block_bytes)
            self._hasher.update(data[lo - position : lo - position + take])
            lo = self._done = lo + take
            if lo == block_end or lo == self._end:
                self._digests.append(self._hasher.hexdigest())
                self._hasher = None

    def result(self) -> BlockDigests:
        """The digests, once every byte of the range was fed.

        Raises:
            ValueError: bytes of the range are missing (a caller's bug, or a short file).
        """
        if self._done != self._end:
            raise ValueError("block hashing ended before its range did")
        return BlockDigests(
            at=self._at,
            length=self._length,
            block_bytes=self._block_bytes,
            digests=tuple(self._digests),
        )
