"""Checksums: streaming equals one-shot, every algorithm names itself, flips change it."""

from __future__ import annotations

import os
import signal
import time

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


def test_blake3_is_the_reference_blake3() -> None:
    """The published BLAKE3 test vector (empty input), so a manifest's ``blake3:`` digest is
    checkable by any BLAKE3 implementation, not only this package."""
    empty = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert digest_bytes(b"", ChecksumAlgorithm.BLAKE3) == f"blake3:{empty}"
    assert parse_checksum(f"blake3:{empty}") == (ChecksumAlgorithm.BLAKE3, empty)


@pytest.mark.parametrize("algorithm", list(ChecksumAlgorithm))
def test_large_updates_split_anywhere_give_one_digest(algorithm: ChecksumAlgorithm) -> None:
    """Items are hashed in chunks of whatever size a read or write brings (BLAKE3 spreads a
    large update over threads): the digest must not depend on where the chunks fall."""
    data = os.urandom((3 << 20) + 12_345)
    whole = digest_bytes(data, algorithm)
    for cut in (1, 65_536, 1 << 20, (2 << 20) + 7):
        hasher = new_hasher(algorithm)
        hasher.update(memoryview(data)[:cut])
        hasher.update(memoryview(data)[cut:])
        assert format_checksum(algorithm, hasher) == whole


@pytest.mark.parametrize("size_hint", [None, 0, 32 << 10, 64 << 20])
def test_the_size_hint_changes_how_an_item_is_hashed_never_its_digest(
    size_hint: int | None,
) -> None:
    """A hint picks one thread or every core for BLAKE3 (and is ignored by the others); a
    wrong hint costs time, never a different checksum."""
    data = os.urandom((5 << 20) + 3)
    for algorithm in ChecksumAlgorithm:
        hasher = new_hasher(algorithm, size_hint=size_hint)
        hasher.update(data)
        assert format_checksum(algorithm, hasher) == digest_bytes(data, algorithm)


@pytest.mark.timeout(120)
def test_a_forked_child_hashes_blake3_without_waiting_on_the_parents_pool() -> None:
    """BLAKE3 spreads large updates over a thread pool that does not survive fork: a child of
    a process that used it must still hash (on its own thread), not wait forever."""
    data = os.urandom(8 << 20)
    expected = digest_bytes(data, ChecksumAlgorithm.BLAKE3)  # the parent uses its pool
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the digest, or nothing if it hangs (the parent kills it)
        try:
            os.write(write_end, digest_bytes(data, ChecksumAlgorithm.BLAKE3).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 60  # a guard against a hang, not a measure of speed
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read().decode() == expected
