"""What a load would unpickle, checked the way a load checks it: deep verification's last step.

Checksums prove that the bytes are the ones the manifest names, not that loading them is safe:
whoever can write the root re-checksums a planted pickle. So deep verification also runs
``.metadata`` through the restricted unpickler and every object item (a non-tensor, DCP's
``BYTE_IO``) through the weights-only check, after decoding its transforms (zstd), exactly as
:class:`~dcp_safe.dcp.reader.SafeStorageReader` does (:mod:`dcp_safe.checkpoints.restricted`).

An item is an object item when its manifest record has no chunk offset: DCP indexes objects by
name alone and tensors by name and chunk offset, and a load finds an item's record by that same
key, so no item a load would unpickle escapes this check, whatever ``.metadata`` claims.
Nothing here ever unpickles without restriction: with ``allow_pickle`` (the caller trusts the
root) the check is skipped, not run unrestricted.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.restricted import load_metadata, sanitized_object_stream
from dcp_safe.errors import CheckpointCorruptError, UnsafeCheckpointError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import ItemRecord, Manifest
from dcp_safe.manifest.streams import read_verified
from dcp_safe.torch_compat import ExtensionRegistry, StreamTransformExtension

__all__ = ["check_loadable", "object_items"]


def object_items(manifest: Manifest) -> list[ItemRecord]:
    """The items a load hands to DCP's ``load_bytes`` (unpickled), in file order."""
    found = [item for item in manifest.items if item.offset is None]
    return sorted(found, key=lambda item: (item.file, item.start))


def check_loadable(
    backend: Backend, name: str, manifest: Manifest, *, allow_pickle: bool = False
) -> int:
    """Raise unless ``.metadata`` and every object item of ``name`` load without running code.

    Args:
        backend: the root.
        name: a committed checkpoint whose manifest is ``manifest``.
        allow_pickle: the caller trusts the root: nothing is checked (and nothing unpickled).

    Returns:
        The number of object items checked.

    Raises:
        UnsafeCheckpointError: ``.metadata`` or an object item refers to more than plain data.
        CheckpointCorruptError: ``.metadata`` is not DCP metadata, an object item is not a
            saved object, or their bytes do not match the manifest.
    """
    if allow_pickle:
        return 0
    _check_metadata(backend, name, manifest)
    items = object_items(manifest)
    for file_name, group in _by_file(items):
        rel = f"{name}/{file_name}"
        path = backend.full_path(rel)
        try:
            with backend.open_read(rel) as stream:
                for item in group:
                    _check_object(stream, path, item)
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "file is missing") from None
    return len(items)


def _by_file(items: list[ItemRecord]) -> Iterable[tuple[str, list[ItemRecord]]]:
    grouped: dict[str, list[ItemRecord]] = {}
    for item in items:
        grouped.setdefault(item.file, []).append(item)
    return grouped.items()


def _check_metadata(backend: Backend, name: str, manifest: Manifest) -> None:
    rel = f"{name}/{layout.DCP_METADATA}"
    path = backend.full_path(rel)
    record = manifest.file(layout.DCP_METADATA)
    if record is None:
        raise CheckpointCorruptError(path, "not listed in the manifest")
    if record.size > MANIFEST_MAX_BYTES:  # read whole: refused before a byte is read
        raise CheckpointCorruptError(
            path, f"{record.size} bytes, over the {MANIFEST_MAX_BYTES}-byte limit for DCP metadata"
        )
    try:
        with backend.open_read(rel) as stream:
            raw = read_verified(
                stream, path=path, item=None, start=0, length=record.size, checksum=record.checksum
            )
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "file is missing") from None
    try:
        metadata = load_metadata(raw, path)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # not a pickle of DCP metadata at all
        raise CheckpointCorruptError(
            path, f"not DCP metadata ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(path, "not DCP metadata")


def _check_object(stream: Any, path: str, item: ItemRecord) -> None:
    label = item.describe()
    raw = read_verified(
        stream, path=path, item=label, start=item.start, length=item.length, checksum=item.checksum
    )
    try:
        payload: Any = io.BytesIO(raw)
        for extension in ExtensionRegistry().from_descriptor_list(list(item.transforms)):
            if isinstance(extension, StreamTransformExtension):
                payload = io.BytesIO(extension.transform_from(payload).read())
    except Exception as exc:  # an unknown transform, or bytes it cannot decode
        raise CheckpointCorruptError(
            path, f"cannot decode the stored object ({type(exc).__name__}: {exc})", item=label
        ) from None
    try:
        sanitized_object_stream(payload, path, label)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # not something torch.save wrote
        raise CheckpointCorruptError(
            path, f"not a saved object ({type(exc).__name__}: {exc})", item=label
        ) from None
