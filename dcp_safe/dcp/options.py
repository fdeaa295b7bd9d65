"""Validated options for the storage writer and reader (small, frozen, keyword-only)."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from dcp_safe.choices import check_agrees, parse_choice
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.signing import CRYPTOGRAPHIC_CHECKSUMS, checksum_for, resolve_key

__all__ = ["DEFAULT_REPORT_TIMEOUT_S", "Compression", "WriterOptions", "writer_options"]

#: How long a save without collectives waits on storage for a peer (docs/multirank.md).
DEFAULT_REPORT_TIMEOUT_S = 600.0


class Compression(str, enum.Enum):
    NONE = "none"
    ZSTD = "zstd"


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How ``SafeStorageWriter`` writes. Strings are accepted and normalized to enums.

    ``report_timeout_s`` bounds a save without collectives (``use_collectives=False``): how
    long rank 0 waits for every rank's report, and every rank for rank 0's save id.
    ``block_digests``: record per-block digests of large uncompressed tensors, so that a
    resharded load reads only the blocks it needs (docs/integrity.md, "Block digests"); off,
    the manifest is what versions before them wrote.
    """

    compression: Compression = Compression.NONE
    checksum: ChecksumAlgorithm = ChecksumAlgorithm.XXH3_128
    thread_count: int = 1
    fsync: bool = True
    overwrite: bool = False
    # Signs each checkpoint (dcp_safe.manifest.signing); kept out of repr and logs.
    signing_key: bytes | None = field(default=None, repr=False)
    report_timeout_s: float = DEFAULT_REPORT_TIMEOUT_S
    block_digests: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "compression", parse_choice(Compression, self.compression, "compression")
        )
        object.__setattr__(
            self, "checksum", parse_choice(ChecksumAlgorithm, self.checksum, "checksum")
        )
        if not isinstance(self.thread_count, int) or not 1 <= self.thread_count <= 64:
            raise ConfigError(f"thread_count must be an int in 1..64, got {self.thread_count!r}")
        timeout = self.report_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigError(f"report_timeout_s must be a number, got {timeout!r}")
        if not (math.isfinite(timeout) and timeout > 0):
            raise ConfigError(f"report_timeout_s must be positive and finite, got {timeout!r}")
        if not isinstance(self.block_digests, bool):
            raise ConfigError(f"block_digests must be a bool, got {self.block_digests!r}")
        if self.signing_key is not None and self.checksum not in CRYPTOGRAPHIC_CHECKSUMS:
            raise ConfigError(
                f"a signed save needs a cryptographic checksum, not {self.checksum.value!r}"
            )


def writer_options(
    options: WriterOptions | None,
    *,
    compression: Compression | str,
    checksum: ChecksumAlgorithm | str | None,
    thread_count: int,
    fsync: bool,
    overwrite: bool,
    signing_key: bytes | str | None,
) -> WriterOptions:
    """``options``, else ``SafeStorageWriter``'s keywords as one :class:`WriterOptions`.

    Either way a missing signing key is ``$DCP_SAFE_SIGNING_KEY``'s, and a signed save's
    checksum left at its default is the signed default (:func:`checksum_for`).

    Raises:
        ConfigError: a keyword set away from its default disagrees with ``options``, or a
            value is unsupported.
    """
    if options is None:
        key = resolve_key(signing_key)
        return WriterOptions(
            compression=parse_choice(Compression, compression, "compression"),
            checksum=checksum_for(checksum, signed=key is not None),
            thread_count=thread_count,
            fsync=fsync,
            overwrite=overwrite,
            signing_key=key,
        )
    if not isinstance(options, WriterOptions):
        raise ConfigError(f"options must be a WriterOptions, got {type(options).__name__}")
    given: dict[str, object] = {
        "compression": parse_choice(Compression, compression, "compression"),
        "thread_count": thread_count,
        "fsync": fsync,
        "overwrite": overwrite,
    }
    defaults = WriterOptions()
    given = {name: value for name, value in given.items() if value != getattr(defaults, name)}
    if checksum is not None:
        given["checksum"] = parse_choice(ChecksumAlgorithm, checksum, "checksum")
    if signing_key is not None:
        given["signing_key"] = resolve_key(signing_key)
    check_agrees(options, given)
    return _signed_by_environment(options)


def _signed_by_environment(options: WriterOptions) -> WriterOptions:
    """``options`` with ``$DCP_SAFE_SIGNING_KEY`` when it names no key, as the keywords do."""
    key = None if options.signing_key is not None else resolve_key(None)
    if key is None:
        return options
    # A checksum at its (unsigned) default was not chosen: a signed save takes the signed one.
    chosen = None if options.checksum is WriterOptions().checksum else options.checksum
    return dataclasses.replace(options, signing_key=key, checksum=checksum_for(chosen, signed=True))
