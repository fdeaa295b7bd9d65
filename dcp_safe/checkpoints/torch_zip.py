"""The records of a ``torch.save`` archive, located without trusting it and never inflated.

``torch.save`` writes every record STORED, so a record here is its bytes as they lie in the item
and any other method is refused before a byte of it is read (torch's reader inflates DEFLATE: a
1 MiB record became 1 GiB). Its own parser rather than :mod:`zipfile`, which builds an object per
directory entry before anything can count them and reads the whole directory at once: here the
end record comes first, the entry count and directory size are checked against
:data:`MAX_RECORDS` and the item's length, then each entry, and only then are bytes handed out.
Zip64 forms are understood. Sources are random-access windows (memory, or a byte range of an
open file), so deep verification reads an archive's directory and pickle, not its tensor bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from dcp_safe.errors import CheckpointCorruptError, UnsafeCheckpointError

#: Records in one item's archive at most (a tensor has 7; an object one more per tensor in it).
MAX_RECORDS = 1 << 16

_EOCD = struct.Struct("<IHHHHIIH")  # signature, disks, entries here/total, size, offset, comment
_LOCATOR = struct.Struct("<IIQI")  # signature, disk, offset of the zip64 end record, disks
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # signature, size, versions, disks, entries, size, offset
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_SIG_EOCD = b"PK\x05\x06"  # bytes: the end record is searched for in the tail
_SIG_LOCATOR, _SIG_EOCD64 = 0x07064B50, 0x06064B50
_SIG_CENTRAL, _SIG_LOCAL = 0x02014B50, 0x04034B50
_STORED = 0
_ENCRYPTED = 0x1
_FULL16, _FULL32 = 0xFFFF, 0xFFFFFFFF
_MAX_COMMENT = 0xFFFF
# One directory entry at most: its fixed part, and a name, extra field and comment of 1 KiB each
# (torch writes far less), so the directory is never read past what its entry count allows.
_MAX_ENTRY_BYTES = _CENTRAL.size + 3 * 1024


class Source(Protocol):
    """Random access to one item's bytes (``length`` of them)."""

    length: int

    def read_at(self, offset: int, size: int) -> bytes | memoryview:
        """``size`` bytes at ``offset`` (fewer only past the end)."""


class MemorySource:
    """An item held in memory; reads are views of it, so a writable buffer (a ``bytearray``)
    lets tensors share its memory instead of copying their bytes."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view = memoryview(data).cast("B")
        self.length, self.writable = self.view.nbytes, not self.view.readonly

    def read_at(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]


class StreamSource:
    """``length`` bytes at ``start`` of an open, seekable file."""

    def __init__(self, stream: BinaryIO, start: int, length: int) -> None:
        self.stream, self.start, self.length = stream, start, length

    def read_at(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.length - offset))
        self.stream.seek(self.start + offset)
        return self.stream.read(size)


@dataclass(frozen=True)
class TorchArchive:
    """A checked archive: its top folder, and where each record's bytes lie."""

    source: Source
    prefix: str
    records: dict[str, tuple[int, int]]  # name: (offset, size)

    def size(self, name: str) -> int | None:
        """The size of record ``name`` (below the top folder), ``None`` if there is none."""
        record = self.records.get(name)
        return None if record is None else record[1]

    def read(self, name: str) -> bytes | memoryview | None:
        """Record ``name``'s bytes (below the top folder), ``None`` if there is none."""
        record = self.records.get(name)
        return None if record is None else self.source.read_at(*record)


def open_archive(
    source: Source, path: str, item: str, *, max_records: int = MAX_RECORDS
) -> TorchArchive:
    """Locate and check every record of the ``torch.save`` archive in ``source``.
    UnsafeCheckpointError: a record is compressed or encrypted, or there are more than
    ``max_records``; CheckpointCorruptError: no such archive (no end record, entries or records
    outside the item, names that disagree or repeat)."""
    return _Parser(source, path, item, max_records).archive()


class _Parser:
    def __init__(self, source: Source, path: str, item: str, max_records: int) -> None:
        self.source, self.path, self.item, self.max_records = source, path, item, max_records

    def corrupt(self, reason: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            self.path, f"not a torch.save archive ({reason})", item=self.item
        )

    def unsafe(self, reason: str) -> UnsafeCheckpointError:
        because = "decoding it would take more memory than the item declares"
        return UnsafeCheckpointError(self.path, reason, item=self.item, because=because)

    def archive(self) -> TorchArchive:
        entries, cd_offset, cd_size, end = self.end_record()
        if entries > self.max_records:
            raise self.unsafe(
                f"the item's archive has {entries} records, more than {self.max_records}"
            )
        if cd_offset + cd_size > end:
            raise self.corrupt("its directory lies outside it")
        if cd_size > entries * _MAX_ENTRY_BYTES:
            raise self.corrupt(f"a directory of {cd_size} bytes for {entries} records")
        directory = bytes(self.source.read_at(cd_offset, cd_size))
        records: dict[str, tuple[int, int]] = {}
        at = 0
        prefix: str | None = None
        for _ in range(entries):
            name, record, at = self.entry(directory, at, cd_offset)
            top, slash, rest = name.partition("/")
            if not slash or not rest or (prefix is not None and top != prefix):
                raise self.corrupt(f"record {name[:80]!r} is not under one top folder")
            prefix = top
            if rest in records:
                raise self.corrupt(f"record {name[:80]!r} appears twice")
            records[rest] = record
        if prefix is None:
            raise self.corrupt("no records")
        return TorchArchive(self.source, prefix, records)

    def end_record(self) -> tuple[int, int, int, int]:
        """(entries, directory offset, directory size, where the end records begin)."""
        length = self.source.length
        # torch writes no comment: the end record is the last 22 bytes. Else search for it.
        tail_start = max(0, length - _EOCD.size)
        tail = bytes(self.source.read_at(tail_start, length - tail_start))
        if not tail.startswith(_SIG_EOCD) or _comment(tail, 0):
            tail_start = max(0, length - _EOCD.size - _MAX_COMMENT)
            tail = bytes(self.source.read_at(tail_start, length - tail_start))
        at = tail.rfind(_SIG_EOCD)
        while at >= 0 and at + _EOCD.size + _comment(tail, at) != len(tail):
            at = tail.rfind(_SIG_EOCD, 0, at)
        if at < 0:
            raise self.corrupt("no end record")
        _, _, _, _, entries, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        end = tail_start + at
        if entries != _FULL16 and _FULL32 not in (cd_size, cd_offset):
            return entries, cd_offset, cd_size, end
        return self.end_record64(end)

    def end_record64(self, eocd: int) -> tuple[int, int, int, int]:
        if eocd < _LOCATOR.size:
            raise self.corrupt("no zip64 locator")
        locator = bytes(self.source.read_at(eocd - _LOCATOR.size, _LOCATOR.size))
        signature, _, offset, _ = _LOCATOR.unpack(locator)
        if signature != _SIG_LOCATOR or offset + _EOCD64.size > eocd - _LOCATOR.size:
            raise self.corrupt("a bad zip64 locator")
        fields = _EOCD64.unpack(bytes(self.source.read_at(offset, _EOCD64.size)))
        if fields[0] != _SIG_EOCD64:
            raise self.corrupt("a bad zip64 end record")
        return fields[7], fields[9], fields[8], offset  # entries, directory offset and size

    def entry(self, directory: bytes, at: int, cd_offset: int) -> tuple[str, tuple[int, int], int]:
        if at + _CENTRAL.size > len(directory):
            raise self.corrupt("its directory ends early")
        fields = _CENTRAL.unpack_from(directory, at)
        signature, flags, method = fields[0], fields[3], fields[4]
        packed, size, name_len, extra_len, comment_len = fields[8:13]
        header = fields[16]
        end = at + _CENTRAL.size + name_len + extra_len + comment_len
        if signature != _SIG_CENTRAL or end > len(directory) or end - at > _MAX_ENTRY_BYTES:
            raise self.corrupt("a bad directory entry")
        raw_name = directory[at + _CENTRAL.size : at + _CENTRAL.size + name_len]
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt("a record name that is not UTF-8") from None
        extra = directory[at + _CENTRAL.size + name_len : at + _CENTRAL.size + name_len + extra_len]
        size, packed, header = _zip64(extra, size, packed, header)
        if flags & _ENCRYPTED or method != _STORED or packed != size:
            raise self.unsafe(
                f"record {name[:80]!r} is compressed or encrypted (method {method});"
                " torch.save writes every record stored"
            )
        data = self.local(header, raw_name, name)
        if data + size > cd_offset:
            raise self.corrupt(f"record {name[:80]!r} runs past its data")
        return name, (data, size), end

    def local(self, header: int, raw_name: bytes, name: str) -> int:
        """Where the record whose local header is at ``header`` begins."""
        fixed = bytes(self.source.read_at(header, _LOCAL.size))
        if len(fixed) != _LOCAL.size:
            raise self.corrupt(f"record {name[:80]!r} has no local header")
        fields = _LOCAL.unpack(fixed)
        name_len, extra_len = int(fields[9]), int(fields[10])
        local_name = bytes(self.source.read_at(header + _LOCAL.size, name_len))
        if fields[0] != _SIG_LOCAL or fields[3] != _STORED or local_name != raw_name:
            raise self.corrupt(f"record {name[:80]!r}: its local header disagrees")
        return header + _LOCAL.size + name_len + extra_len


def _comment(tail: bytes, at: int) -> int:
    if at + _EOCD.size > len(tail):
        return len(tail)  # never a match
    return int.from_bytes(tail[at + 20 : at + 22], "little")


def _zip64(extra: bytes, size: int, packed: int, header: int) -> tuple[int, int, int]:
    """Sizes and offset from a zip64 extra field, where the entry's own fields are full."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + length]
        at += 4 + length
        if tag != 1:
            continue
        values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
        if size == _FULL32 and values:
            size = values.pop(0)
        if packed == _FULL32 and values:
            packed = values.pop(0)
        if header == _FULL32 and values:
            header = values.pop(0)
    return size, packed, header
