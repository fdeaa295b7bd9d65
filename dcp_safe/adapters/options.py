"""Validated options for the storage writer and reader (small, frozen, keyword-only)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field

from dcp_safe.choices import parse_choice, require_int, seconds
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.signing import checksum_for, resolve_key


class Compression(str, enum.Enum):
    NONE = "none"
    ZSTD = "zstd"


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How ``SafeStorageWriter`` writes (strings are normalized to enums): ``compression``
    ``"none"`` or ``"zstd"``; ``checksum`` ``"xxh3_128"`` (unsigned default), ``"blake3"`` (signed
    default), ``"sha256"`` or ``"crc32"``; ``thread_count``: files written in parallel per rank;
    ``fsync``: files and directory entries made durable before publishing; ``overwrite``: a
    committed checkpoint of the same name may be replaced (the old one loads until then);
    ``signing_key`` signs every checkpoint (bytes; a str is its UTF-8 bytes, or ``"hex:<digits>"``;
    the writer defaults it to ``$DCP_SAFE_SIGNING_KEY``: docs/integrity.md, "Signed
    checkpoints"); ``report_timeout_s`` bounds a save without collectives (rank 0's wait for every
    report, every rank's for rank 0's save id); ``block_digests`` records per-block digests of
    large uncompressed tensors, so a resharded load reads only the blocks it needs (off: manifests
    as before them; docs/integrity.md, "Block digests").
    """

    compression: Compression = Compression.NONE
    # None: the default of a save signed or not (checksum_for), decided in __post_init__.
    checksum: ChecksumAlgorithm = None  # type: ignore[assignment]
    thread_count: int = 1
    fsync: bool = True
    overwrite: bool = False
    signing_key: bytes | None = field(default=None, repr=False)  # out of repr and logs
    report_timeout_s: float = 600.0
    block_digests: bool = True

    def __post_init__(self) -> None:
        normalize = functools.partial(object.__setattr__, self)
        normalize("compression", parse_choice(Compression, self.compression, "compression"))
        key = None if self.signing_key is None else resolve_key(self.signing_key)
        normalize("signing_key", key)
        normalize("checksum", checksum_for(self.checksum, signed=key is not None))
        require_int("thread_count", self.thread_count, 1, maximum=64)
        seconds("report_timeout_s", self.report_timeout_s)
        if not isinstance(self.block_digests, bool):
            raise ConfigError(f"block_digests must be a bool, got {self.block_digests!r}")


#: ``SafeStorageWriter``'s keywords that repeated :class:`WriterOptions`, and where each went.
WRITER_MOVED = {
    name: f"options=WriterOptions({name}=...)"
    for name in ("compression", "checksum", "thread_count", "fsync", "overwrite", "signing_key")
}

#: The writers' keywords for the fsspec options of the root they upload to (the second is
#: ``NodeLocalWriter``'s): they went into that root.
REPLICA_MOVED = {
    "replicate_storage_options": "replicate_to=Root(url, storage_options=...)",
    "remote_storage_options": "remote=Root(url, storage_options=...)",
}

#: ``SafeStorageReader``'s keywords for the fsspec options of a second root: they went into it.
READER_MOVED = {
    f"{root}_storage_options": f"{root}=Root(url, storage_options=...)"
    for root in ("fallback", "node_cache")
}


def writer_options(options: WriterOptions | None) -> WriterOptions:
    """``options`` (default: ``WriterOptions()``), with ``$DCP_SAFE_SIGNING_KEY`` when it names
    no key; a signed save's checksum left at its default is then the signed default."""
    options = WriterOptions() if options is None else options
    if not isinstance(options, WriterOptions):
        raise ConfigError(f"options must be a WriterOptions, got {type(options).__name__}")
    key = None if options.signing_key is not None else resolve_key(None)
    if key is None:
        return options
    # A checksum at its (unsigned) default was not chosen: a signed save takes the signed one.
    chosen = None if options.checksum is WriterOptions().checksum else options.checksum
    return dataclasses.replace(options, signing_key=key, checksum=checksum_for(chosen, signed=True))
