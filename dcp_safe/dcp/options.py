"""Validated options for the storage writer and reader (small, frozen, keyword-only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeVar

from dcp_safe.choices import parse_choice
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.signing import CRYPTOGRAPHIC_CHECKSUMS

__all__ = ["Compression", "WriterOptions"]

E = TypeVar("E", bound=enum.Enum)


class Compression(str, enum.Enum):
    NONE = "none"
    ZSTD = "zstd"


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How ``SafeStorageWriter`` writes. Strings are accepted and normalized to enums."""

    compression: Compression = Compression.NONE
    checksum: ChecksumAlgorithm = ChecksumAlgorithm.XXH3_128
    thread_count: int = 1
    fsync: bool = True
    overwrite: bool = False
    # Signs each checkpoint (dcp_safe.manifest.signing); kept out of repr and logs.
    signing_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "compression", parse_choice(Compression, self.compression, "compression")
        )
        object.__setattr__(
            self, "checksum", parse_choice(ChecksumAlgorithm, self.checksum, "checksum")
        )
        if not isinstance(self.thread_count, int) or not 1 <= self.thread_count <= 64:
            raise ConfigError(f"thread_count must be an int in 1..64, got {self.thread_count!r}")
        if self.signing_key is not None and self.checksum not in CRYPTOGRAPHIC_CHECKSUMS:
            raise ConfigError(
                f"a signed save needs a cryptographic checksum, not {self.checksum.value!r}"
            )
