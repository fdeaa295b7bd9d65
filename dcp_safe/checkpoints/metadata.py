"""DCP's metadata of a committed checkpoint, as loads, deep verification and ``inspect`` read it.

One function, so the three never disagree: the manifest's plain form
(:mod:`dcp_safe.manifest.dcp_metadata`). An older checkpoint's ``.metadata`` pickle is read only
with ``allow_pickle=True``, then put through the same decoder, its ``storage_data`` matched to
the manifest item by item, so even a trusted pickle cannot point a load at other bytes.
"""

from __future__ import annotations

import dataclasses
import pickle
import weakref
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.errors import CheckpointCorruptError, ConfigError, UnsafeCheckpointError
from dcp_safe.manifest.dcp_metadata import (
    check_declared_sizes,
    check_storage_data,
    decode_dcp_metadata,
    encode_dcp_metadata,
)
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest
from dcp_safe.manifest.streams import read_verified

_T = TypeVar("_T")
_Entry = TensorStorageMetadata | BytesStorageMetadata

# Chunks, path elements and fingerprints an unpickled .metadata may hold per manifest item.
_PICKLED_ELEMENTS_PER_ITEM = 64

# Decoded metadata by manifest object, for as long as that object lives: open_committed
# keeps the last few manifests it parsed, so a restore of the same checkpoint meets it again.
# Decoding is ~0.3 s of Python at 10,000 tensors, about a third of a warm restore. Shared by
# threads: ``get`` and ``setdefault`` are atomic, and the first decode kept is the one kept.
_decoded: dict[int, Metadata] = {}


def read_dcp_metadata(
    backend: Backend, name: str, manifest: Manifest, *, allow_pickle: bool = False
) -> Metadata:
    """DCP's ``Metadata`` of checkpoint ``name``, whose verified manifest is ``manifest``.
    CheckpointCorruptError: it is malformed or disagrees with the manifest;
    UnsafeCheckpointError: no plain metadata, without ``allow_pickle``; ConfigError: not DCP's
    checkpoint (``manifest.data_format``), so no DCP metadata."""
    if manifest.data_format is not None:
        raise ConfigError(
            f"{backend.full_path(name)} holds {manifest.data_format}'s files, not DCP's: it has"
            f" no DCP metadata (load it with dcp_safe.{manifest.data_format})"
        )
    plain = manifest.dcp_metadata
    path = backend.full_path(f"{name}/{layout.DCP_METADATA if plain is None else layout.MANIFEST}")
    if plain is None and not allow_pickle:
        raise UnsafeCheckpointError(
            path,
            f"written before dcp_safe recorded DCP's metadata as plain data in {layout.MANIFEST};"
            " its only copy is this pickle, which dcp_safe does not unpickle by default (to read"
            " such a checkpoint, or re-save it, load it once with allow_pickle=True; dcp-safe"
            " verify takes --allow-pickle)",
        )
    metadata = _decoded.get(id(manifest))
    if metadata is None:
        found = plain if plain is not None else _plain_from_pickle(backend, name, manifest, path)
        metadata = decode_dcp_metadata(found, manifest, path)
        check_declared_sizes(metadata, path)
        # A pickle is read again each time (its file may change): only plain forms are kept.
        if plain is not None and _decoded.setdefault(id(manifest), metadata) is metadata:
            weakref.finalize(manifest, _decoded.pop, id(manifest), None)
    return _fresh(metadata)


def _plain_from_pickle(backend: Backend, name: str, manifest: Manifest, path: str) -> Any:
    """The plain form of the trusted ``.metadata`` pickle (at ``path``), its bytes checked
    against the manifest's record of it and its ``storage_data`` matched to the manifest item
    by item."""
    record = manifest.file(layout.DCP_METADATA)
    if record is None:
        raise CheckpointCorruptError(path, "not listed in the manifest")
    if record.size > MANIFEST_MAX_BYTES:  # read whole: refused before a byte is read
        raise CheckpointCorruptError(
            path, f"{record.size} bytes, over the {MANIFEST_MAX_BYTES}-byte limit for DCP metadata"
        )
    try:
        with backend.open_read(f"{name}/{layout.DCP_METADATA}") as stream:
            raw = read_verified(stream, path, None, 0, record.size, record.checksum)
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "file is missing") from None
    try:
        pickled = pickle.loads(raw)  # the caller trusts this root as code
        check_storage_data(getattr(pickled, "storage_data", None), manifest, path)
        budget = _PICKLED_ELEMENTS_PER_ITEM * (len(manifest.items) + 1)
        return encode_dcp_metadata(pickled, budget=budget)
    except CheckpointCorruptError:
        raise
    except Exception as exc:  # whatever a trusted but odd pickle holds
        raise CheckpointCorruptError(
            path, f"not DCP metadata ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


def _fresh(metadata: Metadata) -> Metadata:
    """A copy a caller may change (a reader sets ``storage_meta``; a planner may add entries or
    change one's chunks or properties): every mutable object the decoder built is new, the
    immutable leaves (``torch.Size``, dtypes, strings, tuples) shared: 50 ms at 10,000
    tensors on a loaded host, a quarter of decoding them."""
    planner = metadata.planner_data
    if planner is not None:
        planner = dict(planner)
        if layout.AUDIT_KEY in planner:  # fingerprints: a dict of dicts
            planner[layout.AUDIT_KEY] = {k: dict(v) for k, v in planner[layout.AUDIT_KEY].items()}
    return dataclasses.replace(
        metadata,
        state_dict_metadata={k: _entry(v) for k, v in metadata.state_dict_metadata.items()},
        planner_data=planner,
        storage_data={k: _shallow(v) for k, v in metadata.storage_data.items()},
    )


def _entry(entry: _Entry) -> _Entry:
    if not isinstance(entry, TensorStorageMetadata):
        return BytesStorageMetadata()
    chunks = [ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes) for c in entry.chunks]
    return TensorStorageMetadata(_shallow(entry.properties), entry.size, chunks)


def _shallow(value: _T) -> _T:
    """A new object of ``value``'s class with its attributes (``copy.copy`` goes through
    ``TensorProperties``' pickling hooks, several times slower)."""
    fresh = object.__new__(type(value))
    fresh.__dict__.update(value.__dict__)
    return fresh
