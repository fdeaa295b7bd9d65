"""dcp_safe under torch_checkpointing: its saves checksummed, committed marker-last and listed
as dcp_safe checkpoints, and its loads verified byte for byte (docs/torch_checkpointing.md).

The optional extra ``dcp-safe[tc]``; import this module, not ``dcp_safe``, to use it::

    from torch_checkpointing import CheckpointManager
    from dcp_safe.torch_checkpointing import manager_config

    mgr = CheckpointManager(manager_config("s3://bucket/run", save="sync"))
    mgr.save("step_000100", {"model": model.state_dict()})

Checkpoint ids are names under the root. A save claims its name before a byte is written
(through :class:`~dcp_safe.commit.strategy.Publication`, the lease on object stores), writes every
file into the save's work folder, each rank reports its files and checksums at
torch_checkpointing's pre-finalize, and rank 0 writes the manifest and the commit marker last at
its finalize. A load reads only committed checkpoints and checks every file it hands over
against the manifest before torch_checkpointing parses a byte of it.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal, cast

import torch

from dcp_safe import layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import (
    CommittedCheckpoint,
    check_signed,
    committed_names,
    open_committed,
)
from dcp_safe.commit.strategy import Publication, strategy_for
from dcp_safe.coordination.group import (
    DEFAULT_DEADLINE_S,
    broadcast_object,
    checkpoint_group,
    gather_objects,
    typed_failures,
    validate_deadline,
)
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    describe,
)
from dcp_safe.manifest.checksum import (
    ChecksumAlgorithm,
    Hasher,
    digest_bytes,
    format_checksum,
    new_hasher,
)
from dcp_safe.manifest.schema import FileRecord, Manifest, RankManifest
from dcp_safe.manifest.signing import checksum_for, resolve_key
from dcp_safe.topology import RootLike, as_root
from dcp_safe.version import __version__

try:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_writer import CallbackArgs, CheckpointWriterConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
except ImportError as exc:  # the extra is optional; say how to get it
    raise ImportError(
        "dcp_safe.torch_checkpointing needs torch-checkpointing: pip install 'dcp-safe[tc]'"
    ) from exc

#: What the manifest of a checkpoint written here records as its ``data_format``.
DATA_FORMAT = "torch_checkpointing"


@dataclass
class SafeStorageConfig(StorageConfig):
    """A torch_checkpointing storage on a dcp_safe root (a local path or an fsspec URL).

    Picklable: torch_checkpointing's async saver builds the storage again in its subprocess.
    ``signing_key`` (default ``$DCP_SAFE_SIGNING_KEY``) signs each save's manifest and refuses
    to load a checkpoint it did not sign; ``checksum`` defaults to xxh3-128, BLAKE3 when signing.
    ``folder``: a local path that stands for the root, so a caller that joins its checkpoint ids
    off a folder of its own (torchtitan's ``checkpoint.folder``) names the root and the
    checkpoints in it (default: a local root's own path).
    """

    root: RootLike
    _: KW_ONLY
    storage_options: dict[str, Any] | None = None
    signing_key: bytes | str | None = None
    checksum: ChecksumAlgorithm | str | None = None
    deadline_s: float = DEFAULT_DEADLINE_S
    folder: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        self.deadline_s = validate_deadline(self.deadline_s)
        self.root = as_root(self.root, self.storage_options)
        self.storage_options = None
        local = self.root.url.removeprefix("file://")
        folder = local if self.folder is None and "://" not in local else self.folder
        self.folder = None if folder is None else os.path.abspath(folder)
        self.signing_key = resolve_key(self.signing_key)
        self.checksum = checksum_for(self.checksum, signed=bool(self.signing_key))

    def create_storage(self) -> SafeStorage:
        return SafeStorage(self)


@dataclass
class _Save:
    """One save of one name in progress on this rank: where it writes and what it wrote."""

    publication: Publication
    group: Any
    files: dict[str, FileRecord] = field(default_factory=dict)
    reported: list[list[FileRecord]] | None = None
    failure: str | None = None  # a write failed: the save is given up


class SafeStorage(Storage):
    """torch_checkpointing's ``Storage`` through a dcp_safe backend (see the module docstring).

    Paths are ``<name>/<file>`` relative to the root (an absolute path under a local root is
    taken relative to it). Writes go to the save's work folder; reads come from committed
    checkpoints only, each file checked against the manifest before a byte is returned.
    """

    def __init__(self, config: SafeStorageConfig) -> None:
        self._config = config
        self._backend: Backend = open_backend(config.root)
        self._algorithm = ChecksumAlgorithm(config.checksum)  # validated by the config
        self._key = config.signing_key if isinstance(config.signing_key, bytes) else None
        self._lock = threading.Lock()
        self._saves: dict[str, _Save] = {}
        self._opened: dict[str, CommittedCheckpoint] = {}

    def _rel(self, path: Path | str) -> str:
        """``path`` relative to the root: ``<name>[/<file>]``, or ``""`` for the root itself
        (the config's ``folder``, or a path under it, resolved from here)."""
        text, folder = os.fspath(path), self._config.folder
        if folder is not None and "://" not in text:
            under = _under(text, folder)
            if under == os.curdir:
                return ""
            # A relative path is a name under the root, unless it leads into the folder from
            # a working directory outside it (torchtitan's ids, joined off a relative folder).
            if under is not None and (os.path.isabs(text) or _under(os.curdir, folder) is None):
                text = under
        rel = PurePosixPath(text.replace(os.sep, "/"))
        if rel.is_absolute() or not rel.parts or ".." in rel.parts or rel.parts[0] == ".":
            raise ConfigError(f"{os.fspath(path)!r} is not a checkpoint path under the root")
        return rel.as_posix()

    def _split(self, path: Path | str) -> tuple[str, str]:
        """``(name, file)``; ``file`` empty for the checkpoint itself."""
        name, _, member = self._rel(path).partition("/")
        if not layout.is_valid_name(name):  # the root too
            raise ConfigError(f"{os.fspath(path)!r} names no checkpoint ({name!r})")
        return name, member

    def save_of(self, name: str, *, fresh: bool = False) -> _Save:
        """The save of ``name`` in progress, begun (its name claimed) on first use, or with
        ``fresh`` (the checkpoint's folder made: a new save) after a failed one.

        Raises:
            CommitError: the save in progress failed (the rest of its writes are refused).
        """
        with self._lock:
            save = self._saves.get(name)
            if save is not None and save.failure is not None and not fresh:
                raise CommitError(f"the save of {name} failed on this rank: {save.failure}")
            if save is None or save.failure is not None:
                save = self._saves[name] = self._begin(name)
            return save

    def _begin(self, name: str) -> _Save:
        """Claim ``name`` for a new save on rank 0; every rank learns its save id (a collective
        where there are several ranks: each rank begins a save exactly once)."""
        group = _group(self._config.deadline_s)
        strategy = strategy_for(self._backend)
        save_id = layout.new_save_id()
        if group is None or torch.distributed.get_rank(group) == 0:
            try:
                strategy.publication(self._backend, name, save_id).claim()
            except Exception as exc:
                if group is not None:
                    self.collective(group, broadcast_object, (save_id, describe(exc)))
                raise
        if group is not None:  # rank 0's save id (and its failure) on every rank
            save_id, failure = self.collective(group, broadcast_object, (save_id, None))
            if failure is not None:
                raise CommitError(f"save of {name} refused on rank 0", {0: failure})
        self._opened.pop(name, None)
        return _Save(strategy.publication(self._backend, name, save_id), group)

    def _work_rel(self, path: Path | str, *, fresh: bool = False) -> tuple[_Save, str, str]:
        name, member = self._split(path)
        save = self.save_of(name, fresh=fresh and not member)
        work = save.publication.work_dir
        return save, member, f"{work}/{member}" if member else work

    def stream_write(self, path: Path) -> io.IOBase:
        save, member, rel = self._work_rel(path)
        with self.failing(save):
            if not layout.is_member_path(member):  # a manifest names files one folder deep
                raise ConfigError(f"{os.fspath(path)!r} is not a file a checkpoint can hold")
            return _HashingWriter(self, rel, member, save)

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        # torch_checkpointing makes a save's folders before it writes a file, the checkpoint's
        # own first: that is where a new save of a name begins after a failed one.
        save, _, rel = self._work_rel(path, fresh=True)
        with self.failing(save):
            self._backend.makedirs(rel)

    def finish(self, name: str) -> None:
        """Forget the save of ``name`` (published or failed)."""
        with self._lock:
            self._saves.pop(name, None)
            self._opened.pop(name, None)

    def collective(self, group: Any, call: Callable[[Any, Any], Any], value: Any) -> Any:
        """``call(value, group)``; a peer that died or hung: the group is dropped (it is dead)
        and a CommitError says so."""
        with typed_failures(group, deadline_s=self._config.deadline_s):
            return call(value, group)

    def failed(self, save: _Save, exc: BaseException) -> None:
        """A write of ``save`` failed, so it cannot publish: refuse its other writes, remove
        this rank's files and give up the claim (marked abandoned where peers' files stay), so
        the name can be saved again."""
        with self._lock:
            if save.failure is not None:
                return
            save.failure = describe(exc)
        save.publication.abandon(list(save.files), shared=save.group is not None)

    @contextlib.contextmanager
    def failing(self, save: _Save) -> Iterator[None]:
        """Whatever the block raises gives ``save`` up (:meth:`failed`) on its way out."""
        try:
            yield
        except BaseException as exc:
            self.failed(save, exc)
            raise

    def _committed(self, name: str) -> CommittedCheckpoint:
        """``name``'s marker and manifest (checked against each other, and the signature)."""
        with self._lock:
            opened = self._opened.get(name)
        if opened is None:
            opened = open_committed(self._backend, name)
            if self._key is not None:
                check_signed(self._backend, opened, self._key)
            with self._lock:
                self._opened[name] = opened
        return opened

    def _record(self, path: Path | str) -> tuple[str, FileRecord]:
        name, member = self._split(path)
        record = self._committed(name).manifest.file(member) if member else None
        if record is None:
            raise FileNotFoundError(f"{self._backend.full_path(self._rel(path))}: not a file")
        return f"{name}/{member}", record

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """The file, every byte checked against its manifest record before any is returned."""
        return _CheckedFile(self._backend, *self._record(path))

    @property
    def mmap_fill_workers(self) -> int | None:
        return 1  # each parallel fill worker would read and check the whole file again

    def getsize(self, path: Path) -> int:
        return self._record(path)[1].size

    def exists(self, path: Path) -> bool:
        """The root, a committed checkpoint, or a file its manifest lists: nothing uncommitted
        exists."""
        if not self._rel(path):
            return True
        name, member = self._split(path)
        if not member:  # a load begins by asking for the checkpoint: read its manifest afresh
            with self._lock:
                self._opened.pop(name, None)
        try:
            manifest = self._committed(name).manifest
        except CheckpointNotFoundError:
            return False
        return not member or manifest.file(member) is not None or _is_folder(manifest, member)

    def isdir(self, path: Path) -> bool:
        if not self._rel(path):
            return True
        name, member = self._split(path)
        return self.exists(path) and (
            not member or _is_folder(self._committed(name).manifest, member)
        )

    def ls(self, path: Path) -> list[str]:
        rel = self._rel(path)
        if not rel:  # the root: its committed checkpoints
            return sorted(committed_names(self._backend))
        if "/" not in rel and not self.exists(path):
            return []
        return sorted(self._backend.list_dir(rel))

    def delete(self, path: Path) -> None:
        raise OSError(f"delete of {path} refused: files are removed with the checkpoint (rmdir)")

    def rmdir(self, path: Path) -> None:
        """Remove a checkpoint (torchtitan's retention does): unpublished in one step first,
        so a removal cut short never leaves a listed checkpoint with files missing."""
        name, member = self._split(path)
        if member:
            raise OSError(f"rmdir of {path} refused: only a whole checkpoint is removed")
        self._opened.pop(name, None)
        strategy_for(self._backend).retire(self._backend, name)

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        raise OSError(
            f"rename of {src_path} refused: dcp_safe publishes with its commit marker, not a "
            "rename (use manager_config(), which sets write_to_temp_dir=False)"
        )

    def remap_path(self, path: Path) -> str:
        return self._backend.full_path(self._rel(path))


def _under(path: str, folder: str | os.PathLike[str]) -> str | None:
    """``path`` relative to ``folder`` (``"."``: the folder) where it lies there, else None."""
    rel = os.path.relpath(os.path.abspath(path), folder)
    return None if rel.split(os.sep)[0] == os.pardir else rel


def _is_folder(manifest: Manifest, member: str) -> bool:
    # ``member`` comes from _split: normalized, so it never ends in "/".
    return any(record.path.startswith(f"{member}/") for record in manifest.files)


class _CheckedFile(io.RawIOBase):
    """A committed file handed over only once all of it is checked. torch_checkpointing's load
    reads a file with one ``readinto`` the size of the file (its mmap fill): the bytes go
    straight into that buffer, each few MiB hashed as it lands (while still in the CPU's cache:
    no second pass over memory), and are checked before the call returns, one copy. Any
    other read (a smaller buffer, a seek, a second pass) reads the file into memory once,
    checks it, and serves ranged reads from those bytes."""

    def __init__(self, backend: Backend, rel: str, record: FileRecord) -> None:
        super().__init__()
        self._backend, self._rel, self._record = backend, rel, record
        self._full = backend.full_path(rel)
        self._checked: io.BytesIO | None = None
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        # Every view of the caller's buffer is released before this returns or raises: the
        # caller closes its mmap after a failed read, which views still held would refuse.
        with memoryview(buffer) as raw, raw.cast("B") as view:
            size = self._record.size
            if self._checked is not None or self._pos != 0 or len(view) < size:
                return self._memory().readinto(view)
            try:
                got, extra, hasher = self._read_into(view, size)
            except OSError:  # a fault mid-read (the open is retried, a read is not), or missing
                return self._memory().readinto(view)
            _check(self._full, self._record, got + extra, hasher)
            self._pos = size
            return size

    def readall(self) -> bytes:
        return self._memory().read()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._memory().seek(offset, whence)

    def tell(self) -> int:
        return self._pos if self._checked is None else self._checked.tell()

    def _read_into(self, view: memoryview, size: int) -> tuple[int, int, Hasher]:
        """The file read into ``view``: (bytes read, up to ``size``; 1 if more follow, else 0;
        the hash of the bytes read)."""
        got, hasher = 0, _hasher(self._full, self._record)
        with self._backend.open_read(self._rel) as f:
            while got < size:
                with view[got : min(got + _STEP, size)] as step:
                    n = cast(io.BufferedIOBase, f).readinto(step)  # BinaryIO omits it
                    with step[:n] as read:
                        hasher.update(read)
                if not n:
                    break
                got += n
            return got, len(f.read(1)), hasher

    def _memory(self) -> io.BytesIO:
        if self._checked is None:
            try:
                data = self._backend.read_bytes(self._rel)  # retried where the backend retries
            except FileNotFoundError:
                raise CheckpointCorruptError(self._full, "file is missing") from None
            _check(self._full, self._record, len(data), _hasher(self._full, self._record, data))
            self._checked = io.BytesIO(data)
            self._checked.seek(self._pos)
        return self._checked


#: How much of a file is written or read at a time, then hashed while its bytes are still in
#: the CPU's cache (no second pass over memory); a local write also starts its writeback early.
_STEP = 4 << 20


def _hasher(path: str, record: FileRecord, data: bytes | memoryview = b"") -> Hasher:
    """A hasher of the algorithm ``record``'s checksum names (refused where it names none),
    fed ``data``."""
    if record.checksum is None:
        raise CheckpointCorruptError(path, "manifest records no checksum for the file")
    hasher = new_hasher(record.checksum.partition(":")[0], size_hint=record.size)
    hasher.update(data)
    return hasher


def _check(path: str, record: FileRecord, size: int, hasher: Hasher) -> None:
    """Raise unless the ``size`` bytes ``hasher`` hashed are the file ``record`` describes,
    naming the bytes that differ."""
    if size != record.size:
        raise CheckpointCorruptError(
            path,
            f"file size differs from the manifest (bytes 0..{size} read)",
            expected=record.size,
            actual=size,
        )
    actual = format_checksum(str(record.checksum).partition(":")[0], hasher)
    if actual != record.checksum:
        raise CheckpointCorruptError(
            path,
            f"checksum mismatch in bytes 0..{record.size}",
            expected=record.checksum,
            actual=actual,
        )


class _HashingWriter(io.RawIOBase):
    """A backend write stream that hashes what passes and records the file once it is whole."""

    def __init__(self, storage: SafeStorage, rel: str, member: str, save: _Save) -> None:
        super().__init__()
        self._stack = contextlib.ExitStack()
        self._file = self._stack.enter_context(storage._backend.open_write(rel))
        self._hasher = new_hasher(storage._algorithm)
        self._storage, self._member, self._save = storage, member, save
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), _STEP):
            step = view[at : at + _STEP]
            self._file.write(step)
            self._hasher.update(step)
        self._size += len(view)
        return len(view)

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        elif not self.closed:
            try:
                self._stack.__exit__(*exc)
            finally:
                super().close()
                self._storage.failed(self._save, exc[1])

    def close(self) -> None:
        if self.closed:
            return
        try:
            with self._storage.failing(self._save):
                self._stack.close()
        finally:
            super().close()
        self._save.files[self._member] = FileRecord(
            path=self._member,
            size=self._size,
            checksum=format_checksum(self._storage._algorithm, self._hasher),
        )


def _group(deadline_s: float) -> Any:
    """The checkpoint group where several ranks save, else None.

    Raises:
        ConfigError: ranks the environment names but no process group joins (an async
            saver's subprocess: not supported yet, rather than each rank publishing alone).
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        several = dist.get_world_size() > 1
        return checkpoint_group(deadline_s, purpose="torch_checkpointing") if several else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "dcp_safe.torch_checkpointing publishes through a process group; none is "
            "initialized here (the async saver's subprocess on several ranks is not supported yet)"
        )
    return None


def _save_of(args: CallbackArgs) -> tuple[SafeStorage, str, _Save, int]:
    """The storage, name, save in progress and group rank a callback is about."""
    storage = args.storage
    if not isinstance(storage, SafeStorage):
        raise ConfigError("dcp_safe's callbacks need SafeStorageConfig's storage")
    name, _ = storage._split(args.path)
    save = storage.save_of(name)
    return storage, name, save, 0 if save.group is None else torch.distributed.get_rank(save.group)


def _report(args: CallbackArgs) -> None:
    """torch_checkpointing's pre-finalize, on every rank: write this rank's manifest of its
    files, then gather every rank's records to rank 0."""
    storage, name, save, rank = _save_of(args)
    publication, group = save.publication, save.group
    files = tuple(sorted(save.files.values(), key=lambda f: f.path))
    algorithm, rank_rel = storage._algorithm, layout.rank_manifest_name(rank)
    with storage.failing(save):
        rank_manifest = RankManifest(
            name=name,
            save_id=publication.save_id,
            rank=rank,
            checksum_algorithm=algorithm.value,
            files=files,
            items=(),
        ).to_json()
        storage._backend.makedirs(f"{publication.work_dir}/{layout.RANKS_DIR}")
        storage._backend.write_bytes(f"{publication.work_dir}/{rank_rel}", rank_manifest)
        checksum = digest_bytes(rank_manifest, algorithm)
        own = [*files, FileRecord(path=rank_rel, size=len(rank_manifest), checksum=checksum)]
        save.reported = [own] if group is None else storage.collective(group, gather_objects, own)


def _finalize(args: CallbackArgs) -> None:
    """torch_checkpointing's finalize, on every rank: rank 0 writes the manifest and the commit
    marker last; every rank raises if that failed."""
    storage, name, save, rank = _save_of(args)
    group, failure = save.group, None
    try:
        if rank == 0:
            try:
                _publish(storage, name, save)
            except Exception as exc:
                failure = describe(exc)
                if group is None:
                    raise
        if group is not None:
            failure = storage.collective(group, broadcast_object, failure)
        if failure is not None:
            raise CommitError(f"save of {name} was not published", {0: failure})
    finally:
        storage.finish(name)


def _publish(storage: SafeStorage, name: str, save: _Save) -> None:
    publication, reported = save.publication, save.reported
    if reported is None:
        raise CommitError(f"save of {name}: no rank reported its files (no pre-finalize ran)")
    seen: dict[str, int] = {}
    for rank, records in enumerate(reported):
        for record in records:
            if (first := seen.setdefault(record.path, rank)) != rank:
                raise CommitError(
                    f"save of {name}: {record.path} written by ranks {first} and {rank}"
                )
    manifest = Manifest(
        name=name,
        save_id=publication.save_id,
        world_size=len(reported),
        created_at=time.time(),
        checksum_algorithm=storage._algorithm.value,
        compression="none",
        files=tuple(record for records in reported for record in records),
        items=(),
        dcp_safe_version=__version__,
        torch_version=torch.__version__,
        step=_step_of(name),
        data_format=DATA_FORMAT,
    )
    try:
        publication.publish_manifest(manifest, {}, signing_key=storage._key)
    except BaseException as exc:
        publication.discard(exc)
        raise


def _step_of(name: str) -> int | None:
    """The step a name ends in (``step_000100``: 100), as dcp_safe's own saves record it."""
    digits = name[len(name.rstrip("0123456789")) :]
    return int(digits) if digits else None


def manager_config(
    root: RootLike,
    *,
    save: Literal["async", "sync"] = "async",
    storage_options: dict[str, Any] | None = None,
    signing_key: bytes | str | None = None,
    checksum: ChecksumAlgorithm | str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    folder: str | os.PathLike[str] | None = None,
    **options: Any,
) -> CheckpointManager.Config:
    """A ``CheckpointManager.Config`` that saves to ``root`` as dcp_safe does (module docstring).

    ``options``: the rest of ``CheckpointManager.Config`` (``items``, ``default``, ``load``,
    ``subprocess_init_fn``...); its storage, saver and callbacks are this module's.

    Raises:
        ConfigError: an unknown ``save``, or an option this function sets itself.
    """
    taken = {"storage_config", "save", "pre_finalize_callback", "finalize_callback"} & set(options)
    if taken:
        raise ConfigError(f"manager_config() sets {sorted(taken)} itself")
    savers = {"sync": SyncCheckpointSaverConfig, "async": AsyncCheckpointSaverConfig}
    if save not in savers:
        raise ConfigError(f"save must be 'async' or 'sync', got {save!r}")
    return CheckpointManager.Config(
        storage_config=SafeStorageConfig(
            root,
            storage_options=storage_options,
            signing_key=signing_key,
            checksum=checksum,
            deadline_s=deadline_s,
            folder=folder,
        ),
        save=savers[save](writer_config=CheckpointWriterConfig(write_to_temp_dir=False)),
        pre_finalize_callback=_report,
        finalize_callback=_finalize,
        **options,
    )
