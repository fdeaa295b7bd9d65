"""Import Hugging Face weights: a DCP ``StorageReader`` over safetensors files.

A source is a model folder (holding ``model.safetensors.index.json`` or ``model.safetensors``),
or either file, local or any fsspec URL. Each tensor is one chunk to DCP's own load planner,
which reshards it onto the live state (DTensor, FSDP2); each rank reads only its rows.

Why not DCP's ``HuggingFaceStorageReader``: it memory-maps local files only, lists the folder
rather than following the index, reads an unknown dtype as the default one and trusts the
header. Here each header (8 bytes little-endian length, then JSON) is checked on every rank
before a byte of data is read: known dtypes, ``data_offsets`` spanning exactly dtype x shape,
tensors tiling the data section with no gap or overlap up to the file's end, an index that
lists exactly the tensors its files hold. Anything else, a truncated file included, is a
:class:`~dcp_safe.errors.CheckpointCorruptError` naming the file and the tensor.

:attr:`SafetensorsReader.digest` (recorded in the history) is sha256 of the index (if any),
then each file's name, size and header: safetensors carries no checksums, and hashing every
byte would read the whole model on one rank where each reads only its share. The header pins
each tensor's name, dtype, shape and place; the sizes pin the rest.

Memory: a read holds at most :data:`PIECE_BYTES` beyond its target, a header at most
:data:`MAX_HEADER_BYTES` (the ``safetensors`` library's limit). Local files are opened through
fsspec, following links: the Hub's cache links each file of a snapshot to its blob.
"""

from __future__ import annotations

import hashlib
import math
import os
import posixpath
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeGuard

import torch
from fsspec.utils import get_protocol
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dcp_safe import layout
from dcp_safe.adapters.tensor_records import tensor_bytes
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.adopt import check_tiling
from dcp_safe.errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError
from dcp_safe.manifest.limits import CONTROL_MAX_BYTES, parse_json
from dcp_safe.manifest.streams import read_fully, short_read
from dcp_safe.reading.plain import PlainReader, done
from dcp_safe.topology import Root

#: What a name map takes (a tensor's name in the files) and gives (its state-dict key, or
#: ``None`` to leave that tensor out).
NameMap = Callable[[str], str | None]

MAX_HEADER_BYTES = 100 << 20
_MAX_INDEX_BYTES = 64 * CONTROL_MAX_BYTES
PIECE_BYTES = 16 << 20
_SUFFIXES = (".safetensors", ".safetensors.index.json")
RESERVED = "__metadata__"  # the header's own entry: no tensor may have this key

# The safetensors format's dtype codes, as CODE=torch's name.
_CODES = """F64=float64 F32=float32 F16=float16 BF16=bfloat16 I64=int64 I32=int32 I16=int16 I8=int8
U8=uint8 U16=uint16 U32=uint32 U64=uint64 BOOL=bool F8_E4M3=float8_e4m3fn F8_E5M2=float8_e5m2
C64=complex64"""
DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, _, name in (p.partition("=") for p in _CODES.split())
}


@dataclass(frozen=True)
class SafetensorsSource:
    """Hugging Face weights to restore from (docs/resume.md, "Starting from Hugging Face
    weights"): ``Resume(initial_load_from=)`` or ``CheckpointManager.restore(source=)``.

    A plain path or URL there is read as safetensors too when it names such a file or a folder
    holding one, with the default name map and the manager's root's storage options.

    Args:
        url: a model folder (holding ``model.safetensors.index.json`` or ``model.safetensors``),
            or either file; a local path or an fsspec URL.
        name_map: each tensor's state-dict key from its name in the files (``None`` returned:
            leave it out). Default: the name as it is. DCP flattens a nested state dict with
            dots: for ``{"model": model.state_dict()}`` pass ``lambda n: "model." + n``.
        storage_options: fsspec options for ``url`` (default: the manager's root's).

    Raises:
        ConfigError: an empty ``url`` or a ``name_map`` that is not callable.
    """

    url: str | os.PathLike[str]
    name_map: NameMap | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", os.fspath(self.url))
        if not self.url:
            raise ConfigError("a SafetensorsSource needs a path or URL")
        if self.name_map is not None and not callable(self.name_map):
            raise ConfigError(f"name_map must be callable, got {self.name_map!r}")


def is_safetensors_file(url: str) -> bool:
    """Whether ``url`` names a safetensors file or index (by its name)."""
    return url.rstrip("/").endswith(_SUFFIXES)


def locate(source: Root, *, required: bool) -> str | None:
    """The file to read for ``source``: itself when it names one, else the index or
    ``model.safetensors`` in the folder; ``None`` when it holds neither (not ``required``).

    Raises:
        CheckpointNotFoundError: ``required`` and there is no such file.
    """
    url = source.url.rstrip("/")
    if is_safetensors_file(url):
        return url
    backend = _backend(Root(url, source.storage_options))
    for name in (layout.SAFETENSORS_INDEX, layout.SAFETENSORS_FILE):
        if backend.exists(name):
            return f"{url}/{name}"
    if required:
        why = f"no {layout.SAFETENSORS_INDEX} or {layout.SAFETENSORS_FILE} there"
        raise CheckpointNotFoundError(url, why)
    return None


@dataclass(frozen=True)
class _Place:
    """Where one tensor's bytes lie: in ``file`` (under the source's folder), from ``start``."""

    name: str
    file: str
    start: int
    length: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsReader(PlainReader):
    """Reads a safetensors source (the file or index :func:`locate` gives) for ``dcp.load``
    (DCP's load planner reshards it); ``digest``: ``"sha256:<hex>"`` of its index and headers,
    once read.

    Call order (DCP's): ``reset`` (every rank parses and checks every header, before any
    collective), ``read_metadata``, ``set_up_storage_reader``, the plans, then ``read_data``
    with this rank's requests.
    """

    def __init__(self, source: Root, name_map: NameMap | None = None) -> None:
        super().__init__()
        folder, self._entry = posixpath.split(source.url.rstrip("/"))
        self._backend = _backend(Root(folder or ".", source.storage_options))
        self._name_map = name_map
        self._places: dict[MetadataIndex, _Place] = {}
        self.digest: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Read and check the source's index and headers (``checkpoint_id`` is ignored: the
        source was given when the reader was built). DCP calls it before any collective, so
        its errors reach the caller as they are, as :class:`SafeStorageReader`'s do.

        Raises:
            CheckpointCorruptError: a header or the index disagrees with itself or the files.
            ConfigError: the name map gave one key for two tensors, or a key that is no str.
        """
        hasher = hashlib.sha256()
        keyed = _mapped(_read_layout(self._backend, self._entry, hasher), self._name_map)
        self.digest = f"sha256:{hasher.hexdigest()}"
        self._metadata = Metadata(
            state_dict_metadata={
                key: TensorStorageMetadata(
                    TensorProperties(dtype=p.dtype),
                    torch.Size(p.shape),
                    [ChunkStorageMetadata(torch.Size([0] * len(p.shape)), torch.Size(p.shape))],
                )
                for key, p in keyed.items()
            },
            storage_data={MetadataIndex(k, [0] * len(p.shape)): p for k, p in keyed.items()},
            storage_meta=StorageMeta(),
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self._places = metadata.storage_data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._places[item.storage_index].file, []).append(item)
        for file, items in sorted(by_file.items()):
            with self._backend.open_read(file) as stream:
                for item in items:
                    self._read(stream, item, planner)
        return done()

    def _read(self, stream: BinaryIO, item: ReadItem, planner: LoadPlanner) -> None:
        """Copy ``item``'s region into its target, whole rows of dim 0 at a time."""
        place = self._places[item.storage_index]
        target = planner.resolve_tensor(item).detach()
        rows = target if target.dim() else target.view(1)
        row_shape = place.shape[1:]
        row_bytes = math.prod(row_shape) * place.dtype.itemsize
        first, count = (item.storage_offsets[0], item.lengths[0]) if place.shape else (0, 1)
        inner = tuple(
            slice(o, o + n) for o, n in zip(item.storage_offsets[1:], item.lengths[1:], strict=True)
        )
        step = max(1, PIECE_BYTES // max(row_bytes, 1))
        for at in range(0, count, step):
            n = min(step, count - at)
            piece = torch.empty((n, *row_shape), dtype=place.dtype)
            stream.seek(place.start + (first + at) * row_bytes)
            got = read_fully(stream, tensor_bytes(piece))
            if got != n * row_bytes:
                raise short_read(
                    self._backend.full_path(place.file), place.name, n * row_bytes, got
                )
            rows[at : at + n].copy_(piece[(slice(None), *inner)])
        planner.commit_tensor(item, target)


def _backend(root: Root) -> Backend:
    if get_protocol(root.url) in ("file", "local"):
        return FsspecBackend(os.path.abspath(root.url), root.storage_options or {})
    return open_backend(root)


def _read_layout(backend: Backend, entry: str, hasher: Any) -> dict[str, _Place]:
    """Every tensor of the source whose file or index is ``entry``, checked (module docstring)."""
    if not entry.endswith(".index.json"):
        return _read_header(backend, entry, hasher)
    path = backend.full_path(entry)
    raw = backend.read_small(entry, _MAX_INDEX_BYTES)
    hasher.update(raw)
    index = parse_json(raw, path)
    weights = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weights, dict) or not all(
        isinstance(v, str) and v and "/" not in v and not v.startswith(".")
        for v in weights.values()
    ):
        raise CheckpointCorruptError(path, "no weight_map of tensor names to file names")
    places: dict[str, _Place] = {}
    for file in sorted(set(weights.values())):
        held = _read_header(backend, file, hasher)
        listed = {name for name, f in weights.items() if f == file}
        if listed != set(held):
            odd = sorted(listed ^ set(held))[:5]
            raise CheckpointCorruptError(
                backend.full_path(file), f"the index and the file disagree on tensors {odd}"
            )
        places |= held
    return places


def _read_header(backend: Backend, file: str, hasher: Any) -> dict[str, _Place]:
    path = backend.full_path(file)
    size = backend.size(file)
    with backend.open_read(file) as stream:
        prefix = stream.read(8)
        (length,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (-1,)
        most = min(MAX_HEADER_BYTES, size - 8)
        if not 0 <= length <= most:
            why = "not a safetensors file: its header length does not fit the file"
            raise CheckpointCorruptError(path, why, expected=f"<= {most}", actual=length)
        raw = stream.read(length)
    if len(raw) != length:
        raise short_read(path, None, length, len(raw))
    hasher.update(f"{file}\0{size}\0".encode())
    hasher.update(prefix + raw)
    header = parse_json(raw, path)
    if not isinstance(header, dict):
        raise CheckpointCorruptError(path, "the safetensors header is not a JSON object")
    base = 8 + length
    places = {n: _place(path, file, n, e, base) for n, e in header.items() if n != RESERVED}
    check_tiling(path, [(p.name, p.start, p.length) for p in places.values()], base, size, "tensor")
    return places


def _place(path: str, file: str, name: str, entry: object, base: int) -> _Place:
    """One header entry as a place, its dtype, shape and offsets checked against each other."""
    entry = entry if isinstance(entry, dict) else {}
    dtype = DTYPES.get(str(entry.get("dtype")))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None or not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
        why = "a header entry is not {dtype, shape, data_offsets} of the safetensors format"
        raise CheckpointCorruptError(path, why, item=name, actual=str(entry)[:200])
    begin, nbytes = offsets[0], math.prod(shape) * dtype.itemsize
    if (spans := offsets[1] - begin) != nbytes:
        raise CheckpointCorruptError(
            path, "data_offsets do not span dtype x shape", item=name, expected=nbytes, actual=spans
        )
    return _Place(name, file, base + begin, nbytes, dtype, tuple(shape))


def _naturals(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int and 0 <= v < 1 << 62 for v in value)


def _mapped(places: dict[str, _Place], name_map: NameMap | None) -> dict[str, _Place]:
    """``places`` by state-dict key (``name_map``'s; ``None`` leaves a tensor out)."""
    if name_map is None:
        return places
    keyed: dict[str, _Place] = {}
    for name, place in places.items():
        key = name_map(name)
        if key is None:
            continue
        if not isinstance(key, str) or not key:
            raise ConfigError(f"name_map gave {key!r} for {name!r}: a key is a non-empty str")
        if key in keyed:
            raise ConfigError(f"name_map gives {key!r} for both {keyed[key].name!r} and {name!r}")
        keyed[key] = place
    return keyed
