"""Checksums: streaming equals one-shot, every algorithm names itself, flips change it."""

from __future__ import annotations

import os

import pytest

from dcp_safe.manifest.checksum import (
    ChecksumAlgorithm,
    digest_bytes,
    format_checksum,
    new_hasher,
    parse_checksum,
)


@pytest.mark.parametrize("algorithm", list(ChecksumAlgorithm))
def test_streaming_equals_one_shot_and_detects_a_flip(algorithm: ChecksumAlgorithm) -> None:
    data = os.urandom(100_000)
    hasher = new_hasher(algorithm)
    for start in range(0, len(data), 7_000):
        hasher.update(memoryview(data)[start : start + 7_000])
    streamed = format_checksum(algorithm, hasher)
    assert streamed == digest_bytes(data, algorithm)
    assert parse_checksum(streamed)[0] is algorithm
    flipped = bytearray(data)
    flipped[500] ^= 1
    assert digest_bytes(flipped, algorithm) != streamed


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError):
        parse_checksum("md5:abcd")
