"""DCP's metadata of a checkpoint, as loads, deep verification, ``inspect`` and adopt read it.

One decoder, so they never disagree: the manifest's plain form
(:mod:`dcp_safe.manifest.dcp_metadata`). A ``.metadata`` pickle (an older checkpoint's, read
only with ``allow_pickle=True``; a stock DCP checkpoint's, which
:mod:`~dcp_safe.checkpoints.adopt` adopts) is turned into that form without running it:
:class:`~dcp_safe.checkpoints.item_pickles.Shadows` unpickles it into stand-ins that record
arguments and state, so no class's code runs (not even DCP's ``__setstate__``), and names every
global; one it does not admit is refused (:class:`~dcp_safe.errors.PickledClassesError`, all
named) unless ``allow_pickle``. :class:`_Walk` turns the stand-ins into the plain form; a
committed checkpoint's ``storage_data`` must match its manifest item by item, so even a trusted
pickle cannot point a load at other bytes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.item_pickles import Shadows, StandIn, is_stand_in
from dcp_safe.errors import (
    CheckpointCorruptError,
    ConfigError,
    DcpSafeError,
    PickledClassesError,
    UnsafeCheckpointError,
)
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.dcp_metadata import (
    FORMAT,
    VERSION,
    check_declared_sizes,
    decode_dcp_metadata,
    encode_audit,
)
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import ItemRecord, Manifest
from dcp_safe.manifest.streams import read_verified
from dcp_safe.torch_compat import DCP_LAYOUT, DCP_MEMORY_FORMAT, DCP_STORAGE_INFO

_T = TypeVar("_T")
_Sized = TypeVar("_Sized", bound=Sized)
_Entry = TensorStorageMetadata | BytesStorageMetadata

_DCP = f"{Metadata.__module__}."
_DCP_NAMES = "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata"
_MORE_NAMES = "TensorProperties MetadataIndex StorageMeta"
_PATHS = "pathlib.PosixPath pathlib.WindowsPath pathlib.PurePosixPath pathlib.PureWindowsPath"
_ADMITTED = frozenset(
    [_DCP + n for n in f"{_DCP_NAMES} {_MORE_NAMES}".split()]
    + [DCP_STORAGE_INFO, DCP_LAYOUT, DCP_MEMORY_FORMAT, "torch.Size", *_PATHS.split()]
)
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")  # DCP's encoding
# An adopted item's checksum until adopt reads its bytes.
_PENDING = f"{ChecksumAlgorithm.XXH3_128.value}:0"

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
    return decode_pickled_metadata(memoryview(raw), path, allow_pickle=True, manifest=manifest)[0]


def decode_pickled_metadata(
    raw: bytes | memoryview, path: str, *, allow_pickle: bool, manifest: Manifest | None = None
) -> tuple[dict[str, Any], list[ItemRecord]]:
    """The plain form of the ``.metadata`` pickle ``raw`` (at ``path``) and the items its
    ``storage_data`` names, running no code from it.

    Args:
        allow_pickle: let the globals not admitted be: the walk reads none of them.
        manifest: the committed checkpoint's: every item must say what the manifest's does
            (file, start, length, transforms), and is then the manifest's record. Without
            one, each item's checksum is pending.

    Raises:
        PickledClassesError: globals not admitted (all named), without ``allow_pickle``.
        CheckpointCorruptError: not DCP's metadata, or it disagrees with ``manifest``.
    """
    shadows = Shadows(raw)
    try:
        top = shadows.load()
        refused = sorted({f"{module}.{name}" for module, name in shadows.stands} - _ADMITTED)
        if refused and not allow_pickle:
            raise PickledClassesError(path, refused)
        return _Walk(len(raw), path, manifest).metadata(top)
    except DcpSafeError:
        raise
    except Exception as exc:  # whatever a malformed pickle makes the unpickler or the walk raise
        why = f"not DCP metadata ({type(exc).__name__}: {str(exc)[:200]})"
        raise CheckpointCorruptError(path, why) from None


@dataclass
class _Walk:
    """Stand-ins to plain values (the decoder checks their types); each element counted against
    the pickle's size, since lists shared under many keys would make a naive walk endless."""

    left: int
    path: str
    manifest: Manifest | None

    def take(self, values: _Sized) -> _Sized:
        self.left -= len(values)
        if self.left < 0:
            raise ValueError("more elements than its bytes hold (shared lists)")
        return values

    @staticmethod
    def of(value: object, qualname: str) -> StandIn:
        if not is_stand_in(value, qualname):
            raise ValueError(f"{qualname.rpartition('.')[2]} expected, not {type(value).__name__}")
        return value

    def fields(self, value: object, qualname: str) -> dict[str, Any]:
        state = self.of(value, qualname).state
        if not isinstance(state, dict | None):
            raise ValueError(f"{qualname.rpartition('.')[2]} whose state is not a dict")
        return self.take(state or {})

    def dims(self, value: object) -> list[Any]:
        if is_stand_in(value, "torch.Size"):
            value = value.args[0] if value.args else ()
        if not isinstance(value, tuple):
            raise ValueError("a size that is not a torch.Size")
        return list(self.take(value))

    def metadata(self, top: object) -> tuple[dict[str, Any], list[ItemRecord]]:
        body = self.fields(top, _DCP + "Metadata")
        entries, paths = body["state_dict_metadata"], body.get("planner_data") or {}
        if not isinstance(paths, dict) or not all(
            isinstance(p, tuple) for k, p in paths.items() if k != layout.AUDIT_KEY
        ):
            raise ValueError("planner data that is not DCP's flatten paths (a custom planner's)")
        audit = paths.pop(layout.AUDIT_KEY, None)  # dcp_safe's fingerprints: a dict of dicts
        for blocks in self.take(audit or {}).values():  # counted before encode_audit visits them
            self.take(blocks)
        plain = {
            "format": FORMAT,
            "version": VERSION,
            "dcp_version": body.get("version"),
            "entries": [[key, self.entry(value)] for key, value in self.take(entries).items()],
            "planner_data": {
                "paths": [[k, list(self.take(p))] for k, p in paths.items()],
                "audit": None if audit is None else encode_audit(audit),
            },
        }
        storage = self.take(body["storage_data"])
        return plain, [self.item(index, info) for index, info in storage.items()]

    def entry(self, value: object) -> dict[str, Any] | None:
        if is_stand_in(value, _DCP + "BytesStorageMetadata"):
            return None
        body = self.fields(value, _DCP + "TensorStorageMetadata")
        properties = self.of(body["properties"], _DCP + "TensorProperties").state
        dtype, layout_, grad, memory, pin = properties
        chunks = [self.fields(c, _DCP + "ChunkStorageMetadata") for c in self.take(body["chunks"])]
        return {  # a stand-in is named as no dtype or layout is: the decoder refuses it
            "dtype": str(dtype).removeprefix("torch."),
            "layout": str(self.of(layout_, DCP_LAYOUT).args[0]).removeprefix("torch."),
            "memory_format": _MEMORY_FORMATS[self.of(memory, DCP_MEMORY_FORMAT).args[0]],
            "requires_grad": grad,
            "pin_memory": pin,
            "size": self.dims(body["size"]),
            "chunks": [[self.dims(c["offsets"]), self.dims(c["sizes"])] for c in chunks],
        }

    def item(self, index: object, info: object) -> ItemRecord:
        """An item's record: the manifest's, which the pickle must state exactly; without a
        manifest, its checksum pending (``ItemRecord`` checks every field)."""
        where, at = self.fields(index, _DCP + "MetadataIndex"), self.fields(info, DCP_STORAGE_INFO)
        fqn, offset = where["fqn"], where.get("offset")
        offset = None if offset is None else tuple(self.dims(offset))
        transforms = tuple(at.get("transform_descriptors") or ())
        if self.manifest is None:
            return ItemRecord(
                fqn=fqn,
                offset=offset,
                file=at["relative_path"],
                start=at["offset"],
                length=at["length"],
                checksum=_PENDING,
                transforms=transforms,
            )
        known = self.manifest.item((fqn, offset))
        stated = (at["relative_path"], at["offset"], at["length"], transforms)
        if known is None or (known.file, known.start, known.length, known.transforms) != stated:
            raise CheckpointCorruptError(
                self.path,
                "storage_data disagrees with the manifest (a file, offset or length the"
                " manifest does not record for this item)",
                item=fqn[:200] if isinstance(fqn, str) else "?",
            )
        return known


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
