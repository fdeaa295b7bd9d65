"""The public API: ``__all__`` lists exactly what users may import, and all of it exists."""

from __future__ import annotations

import dcp_safe


def test_all_names_exist_and_are_unique() -> None:
    assert len(set(dcp_safe.__all__)) == len(dcp_safe.__all__)
    for name in dcp_safe.__all__:
        assert hasattr(dcp_safe, name), name


def test_every_public_class_and_function_is_listed() -> None:
    public = {
        name
        for name, obj in vars(dcp_safe).items()
        if not name.startswith("_") and (isinstance(obj, type) or callable(obj))
    }
    assert public <= set(dcp_safe.__all__)


def test_the_design_entry_points_are_public() -> None:
    for name in ("SafeStorageWriter", "SafeStorageReader", "list_checkpoints", "verify_checkpoint"):
        assert name in dcp_safe.__all__


def test_the_peer_tier_failure_is_public() -> None:
    assert "PeerCopyError" in dcp_safe.__all__
    assert issubclass(dcp_safe.PeerCopyError, dcp_safe.DcpSafeError)
