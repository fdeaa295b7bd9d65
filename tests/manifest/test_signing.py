"""The signing key, the signature over a manifest digest, and the checksums it can vouch for."""

from __future__ import annotations

import pytest

from dcp_safe.adapters.options import WriterOptions
from dcp_safe.errors import ConfigError, SignatureError
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.signing import (
    SIGNING_KEY_ENV,
    check_signature,
    checksum_for,
    is_cryptographic,
    resolve_key,
    sign_digest,
)

KEY = b"k" * 32
DIGEST = "sha256:" + "ab" * 32


def test_no_key_anywhere_means_unsigned() -> None:
    assert resolve_key(None, environ={}) is None
    assert resolve_key(None, environ={SIGNING_KEY_ENV: ""}) is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (b"\x00" * 16, b"\x00" * 16),
        (bytearray(b"x" * 20), b"x" * 20),
        ("a passphrase of some length", b"a passphrase of some length"),
        ("hex:" + "0f" * 32, bytes([15]) * 32),
    ],
)
def test_a_key_argument_is_bytes_text_or_hex(given: bytes | str, expected: bytes) -> None:
    assert resolve_key(given, environ={SIGNING_KEY_ENV: "ignored because an argument wins"}) == (
        expected
    )


def test_the_environment_variable_is_the_default() -> None:
    assert resolve_key(None, environ={SIGNING_KEY_ENV: "hex:" + "ff" * 16}) == b"\xff" * 16
    assert resolve_key(None, environ={SIGNING_KEY_ENV: "sixteen-or-more!"}) == b"sixteen-or-more!"


@pytest.mark.parametrize("bad", [b"short", "short", "hex:abc", "hex:" + "zz" * 16, 12345])
def test_short_malformed_or_mistyped_keys_are_config_errors(bad: object) -> None:
    with pytest.raises(ConfigError, match="signing_key"):
        resolve_key(bad, environ={})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["short", "hex:abc", "hex:" + "0" * 30])
def test_a_bad_environment_key_names_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match=SIGNING_KEY_ENV):
        resolve_key(None, environ={SIGNING_KEY_ENV: bad})


def test_a_signature_checks_against_its_key_and_digest_only() -> None:
    signature = sign_digest(KEY, DIGEST)
    assert signature.startswith(b"hmac-sha256:") and signature.endswith(b"\n")
    check_signature(KEY, DIGEST, signature, "p")
    check_signature(KEY, DIGEST, signature.strip() + b"\r\n", "p")  # line endings do not matter
    with pytest.raises(SignatureError, match="does not match the manifest"):
        check_signature(b"j" * 32, DIGEST, signature, "p")
    with pytest.raises(SignatureError, match="does not match the manifest"):
        check_signature(KEY, "sha256:" + "cd" * 32, signature, "p")
    with pytest.raises(SignatureError, match="is not hmac-sha256"):
        check_signature(KEY, DIGEST, b"ed25519:" + signature.partition(b":")[2], "p")
    with pytest.raises(SignatureError):
        check_signature(KEY, DIGEST, b"", "p")


def test_the_signature_is_not_a_bare_hmac_of_the_digest() -> None:
    """Domain separation: an HMAC under the same key of the digest alone is no signature."""
    import hashlib
    import hmac

    bare = hmac.new(KEY, DIGEST.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(SignatureError):
        check_signature(KEY, DIGEST, f"hmac-sha256:{bare}".encode(), "p")


def test_a_signed_save_defaults_to_blake3_and_refuses_weak_checksums() -> None:
    assert checksum_for(None, signed=False) is ChecksumAlgorithm.XXH3_128
    assert checksum_for(None, signed=True) is ChecksumAlgorithm.BLAKE3
    assert checksum_for("sha256", signed=True) is ChecksumAlgorithm.SHA256
    assert checksum_for("blake3", signed=True) is ChecksumAlgorithm.BLAKE3
    assert checksum_for("blake3", signed=False) is ChecksumAlgorithm.BLAKE3
    assert checksum_for("crc32", signed=False) is ChecksumAlgorithm.CRC32
    for weak in ("xxh3_128", "crc32"):
        with pytest.raises(ConfigError, match="not cryptographic"):
            checksum_for(weak, signed=True)
    with pytest.raises(ConfigError, match="checksum must be one of"):
        checksum_for("md5", signed=True)


def test_writer_options_refuse_a_key_with_a_weak_checksum() -> None:
    with pytest.raises(ConfigError, match="cryptographic"):
        WriterOptions(checksum=ChecksumAlgorithm.XXH3_128, signing_key=KEY)
    options = WriterOptions(checksum=ChecksumAlgorithm.SHA256, signing_key=KEY)
    assert "k" * 32 not in repr(options)  # the key stays out of logs
    WriterOptions(checksum=ChecksumAlgorithm.BLAKE3, signing_key=KEY)


def test_only_blake3_and_sha256_count_as_cryptographic() -> None:
    assert is_cryptographic("blake3:00")
    assert is_cryptographic("sha256:00")
    assert not is_cryptographic("xxh3_128:00")
    assert not is_cryptographic("crc32:00")
