"""Any fsspec file system (``memory://``, ``s3://``, ...) behind the backend protocol.

Object stores cannot rename atomically (``supports_atomic_rename=False``): the committer
publishes by writing the ``_COMMITTED`` marker last, with an exclusive write. Exclusive create
is reported only where it is real: on S3 once a probe shows the server honours ``If-None-Match``
(docs/s3.md, "How a checkpoint is committed on S3"); on ``memory://`` by a check and a write
under one lock. fsspec's generic ``mode="create"`` is check-then-write, so elsewhere the flag
stays ``False`` and the commit takes the protocol that needs none.

Streamed writes: S3 as a pipelined multipart upload (:mod:`dcp_safe.backends.s3_upload`); other
object stores stage in the file object, and a failed write is discarded, never closed (closing
an fsspec buffered file publishes what was written); other file systems (``memory://`` publishes
a file as soon as it is opened) write a hidden sibling and move it into place, so a torn write
never sits under its final name. A wrapper that names the storage it wraps as ``target_fs``
(:class:`~dcp_safe.testing.faulty_fs.FaultyFileSystem`) gets that storage's flags and uploads.

Listings are never cached on object stores (``use_listings_cache=False`` unless the caller says
otherwise): a stale listing would make a shard another rank wrote look missing.
"""

from __future__ import annotations

import datetime
import errno
import functools
import logging
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs
from fsspec.utils import get_protocol

from dcp_safe import layout
from dcp_safe.backends.backend import Backend, FileStat, _over_limit, not_a_file, unwrapped
from dcp_safe.backends.retry import s3_error
from dcp_safe.backends.s3_upload import (
    S3MultipartWriter,
    block_size_of,
    parts_in_flight_of,
    upload_buffer_bytes,
)
from dcp_safe.errors import StorageError
from dcp_safe.manifest.streams import WritableFile

# File systems without real directories, whose open("wb") stages the whole object until close.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
# memory:// lives in this process: a lock makes its exclusive create exact.
_IN_PROCESS_CREATE = threading.Lock()
# Whether a server honours If-None-Match, per (endpoint, root), as probed by this process.
_PROBED: dict[tuple[str, str], bool] = {}

log = logging.getLogger(__name__)


class FsspecBackend(Backend):
    """A root on any fsspec file system, addressed by URL.

    Args:
        storage_options: passed to fsspec (credentials, ``endpoint_url``, ...). On S3,
            ``max_concurrency`` (s3fs's per-file transfer concurrency) is also the number of
            parts each streamed upload keeps in flight (default 4) and ``default_block_size``
            the part size (a ConfigError if ``max_concurrency`` is not an int >= 1).
        client_retries: s3fs's own tries per request on S3 (:func:`open_backend` gives 1: the
            retry layer above owns retries); None: s3fs's default.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        client_retries: int | None = None,
    ) -> None:
        from s3fs import S3FileSystem  # a dependency, slow to import: only when needed

        self.url = url
        options = dict(storage_options or {})
        if get_protocol(url) in _OBJECT_STORE_PROTOCOLS:
            options.setdefault("use_listings_cache", False)
        self.fs: fsspec.AbstractFileSystem
        self.fs, root = url_to_fs(url, **options)
        self.root = root.rstrip("/")
        # A wrapper claims nothing of its own: the storage underneath decides.
        target = self._target
        protocols = {target.protocol} if isinstance(target.protocol, str) else set(target.protocol)
        self.object_store = bool({get_protocol(url), *protocols} & _OBJECT_STORE_PROTOCOLS)
        self.process_local = "memory" in protocols
        # Under any wrapper; S3 uploads are pipelined multipart uploads through ``call_s3``,
        # which s3fs has and a wrapper passes on (FaultyFileSystem).
        self.s3 = isinstance(target, S3FileSystem)
        # True, False, or None: to be probed on the server the first time it is asked. s3fs
        # (>= 2024.12, as pinned) sends ``pipe_file(mode="create")`` as a conditional PUT.
        self._exclusive: bool | None = True if self.process_local else None if self.s3 else False
        self.client_retries = client_retries
        self.__setstate__({})
        # Checked now, not at the first upload: a bad option is the caller's, not a storage fault.
        self._parts_in_flight = parts_in_flight_of(target) if self.s3 else 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        # s3fs retries in its own loop (class attribute ``retries``), which no storage option
        # reaches (nor fsspec's rebuild of an unpickled file system): set it on every unpickle.
        self.__dict__.update(state)
        if self.client_retries is not None and self.s3:
            self._target.retries = self.client_retries

    @property
    def _target(self) -> fsspec.AbstractFileSystem:
        """The file system under a wrapper that names it as ``target_fs`` (FaultyFileSystem)."""
        target = getattr(self.fs, "target_fs", None)
        return target if isinstance(target, fsspec.AbstractFileSystem) else self.fs

    @property
    def supports_exclusive_create(self) -> bool:
        if self._exclusive is None:
            self._exclusive = self._probe_exclusive_create()
        return self._exclusive

    @supports_exclusive_create.setter
    def supports_exclusive_create(self, value: bool) -> None:
        self._exclusive = value

    def _probe_exclusive_create(self) -> bool:
        """Whether the server refuses a second ``If-None-Match: *`` create of one object. Sent
        under any fault-injecting wrapper: it asks about the server, and must not shift a test's
        count of operations. A failed probe raises StorageError and is not remembered: a wrong
        answer either way would make two processes disagree on the lease."""
        target = self._target
        key = (str(getattr(target, "endpoint_url", None) or ""), self.root)
        if key in _PROBED:
            return _PROBED[key]
        rel = f"{layout.PROBE_PREFIX}{uuid.uuid4().hex}"
        path = self._abs(rel)
        try:
            # A refusal of the first create can only be our own (the key is ours alone),
            # applied before a lost reply and resent by the client.
            _create_once(target, path, b"first")
            honoured = not _create_once(target, path, b"second")
        except OSError as exc:
            raise self._fail("probe", rel, exc) from exc
        finally:
            with suppress(OSError, ValueError):
                target.rm_file(path)
        if not honoured:
            log.warning(
                "%s ignores If-None-Match: saves take the per-save lease protocol there", self.url
            )
        _PROBED[key] = honoured
        return honoured

    def _abs(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _exists_error(self, rel: str) -> FileExistsError:
        return FileExistsError(errno.EEXIST, "already exists", self.full_path(rel))

    def open_write(self, rel: str) -> AbstractContextManager[WritableFile]:
        return self._open_upload(rel) if self.object_store else self._open_via_temp(rel)

    @contextmanager
    def _open_upload(self, rel: str) -> Iterator[WritableFile]:
        """An upload that only its ``close()`` completes; on any failure it is dropped (safe to
        repeat after a failed close) and the error raised as a write of ``rel``."""
        try:
            if self.s3:
                block, parts = block_size_of(self._target), self._parts_in_flight
                f: Any = S3MultipartWriter(self.fs, self._abs(rel), block, parts_in_flight=parts)
                drop: Callable[[], None] = f.abort
            else:
                f = self.fs.open(self._abs(rel), "wb")
                drop = functools.partial(_discard, f)
        except (OSError, ValueError) as exc:
            raise self._fail("create", rel, exc) from exc
        try:
            yield f
        except BaseException as exc:
            drop()  # nothing was published
            self._raise_write_error(rel, exc)
        try:
            f.close()
        except BaseException as exc:
            drop()
            with suppress(OSError, ValueError):  # the server may have completed it first
                self.fs.rm_file(self._abs(rel))
            self._raise_write_error(rel, exc)

    @contextmanager
    def _open_via_temp(self, rel: str) -> Iterator[WritableFile]:
        head, tail = posixpath.split(rel)
        temp = self._abs(posixpath.join(head, layout.temp_file_name(tail)))
        with self._failing("create", rel):
            # Writes make their folder, as on an object store (fsspec's auto_mkdir is off).
            if head:
                self.fs.makedirs(self._abs(head), exist_ok=True)
            f = self.fs.open(temp, "wb")
        try:
            with f:
                yield f
            self.fs.mv(temp, self._abs(rel))
        except BaseException as exc:
            with suppress(OSError, ValueError):
                self.fs.rm_file(temp)
            self._raise_write_error(rel, exc)

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive and not self.process_local:
            try:
                conditional = self.supports_exclusive_create
            except StorageError as exc:  # a failed probe is reported as this write's failure
                raise self._fail("write", rel, exc.__cause__ or exc) from exc
            if conditional:
                with self._failing("write", rel):
                    made = _create_once(self.fs, self._abs(rel), data)
                if not made:  # a conditional PUT: the server refused it, atomically
                    raise self._exists_error(rel)
                return
        # In process, exact: nothing outside it sees the store; elsewhere best effort only
        # (such a backend says so through its capability flag).
        with _IN_PROCESS_CREATE if exclusive else nullcontext():
            if exclusive and self.exists(rel):
                raise self._exists_error(rel)
            if self.object_store:
                with self._failing("write", rel):
                    self.fs.pipe_file(self._abs(rel), data)
                return
            # A PUT is atomic; a local write is not: a torn lease or marker must never sit
            # under its final name (an unreadable lease would block the name for good).
            with self._open_via_temp(rel) as f:
                f.write(data)

    @contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        if not self.object_store:
            # Opening a FIFO would wait for a writer and a device never ends; object stores
            # hold only objects, so only file systems with special files pay this stat.
            found = self.stat(rel)
            if found.kind != "file":
                raise not_a_file(self.full_path(rel), found.kind)
        with self._failing("open", rel, absent=True):
            f = self.fs.open(self._abs(rel), "rb")
        with f:
            yield f

    def read_bytes(self, rel: str) -> bytes:
        with self._failing("read", rel, absent=True):
            return bytes(self.fs.cat_file(self._abs(rel)))

    def read_small(self, rel: str, max_bytes: int) -> bytes:
        if not self.object_store:
            return super().read_small(rel, max_bytes)  # stat first: it may be a FIFO
        # One ranged GET, not a HEAD, then the open's HEAD, then a GET: an object store holds
        # only objects, and the range bounds the read (a server that ignores it is refused).
        try:
            with self._failing("read", rel, absent=True):
                data = bytes(self.fs.cat_file(self._abs(rel), start=0, end=max_bytes + 1))
        except FileNotFoundError as exc:
            if self.is_dir(rel):  # only when absent: a present file costs one request
                raise not_a_file(self.full_path(rel), "directory") from exc
            raise FileNotFoundError(errno.ENOENT, "no such file", self.full_path(rel)) from exc
        except StorageError as exc:
            if s3_error(exc.__cause__ or exc) == ("InvalidRange", 416):  # no byte 0 to read
                return super().read_small(rel, max_bytes)
            raise
        if len(data) > max_bytes:
            raise _over_limit(self.full_path(rel), max_bytes)
        return data

    def _ls(self, rel: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """The entries directly under ``rel``, by path relative to it, with their details
        (none when it is absent); ``ls`` of a file (or of a key that is also a prefix) can name
        the path itself: left out."""
        prefix = self._abs(rel).rstrip("/") + "/"
        # refresh: a listing cache (a caller's use_listings_cache) would miss new shards.
        refresh = {"refresh": True} if self.object_store else {}
        found = []
        with self._failing("list", rel), suppress(FileNotFoundError, NotADirectoryError):
            found = self.fs.ls(prefix.rstrip("/"), detail=True, **refresh)
        for entry in found:
            name = str(entry.get("name", "")).rstrip("/")
            if name.startswith(prefix):
                yield name.removeprefix(prefix), entry

    def sizes(self, rel: str) -> dict[str, int]:
        return {
            name: int(entry.get("size") or 0)
            for name, entry in self._ls(rel)
            if entry.get("type") == "file" and "/" not in name
        }

    def size(self, rel: str) -> int:
        with self._failing("stat", rel, absent=True):
            return int(self.fs.size(self._abs(rel)))

    def stat(self, rel: str) -> FileStat:
        with self._failing("stat", rel, absent=True):
            info = self.fs.info(self._abs(rel))
        kind = info.get("type")
        if kind == "file":
            return FileStat("file", int(info.get("size") or 0))
        return FileStat("directory" if kind == "directory" else "other", 0)

    def exists(self, rel: str) -> bool:
        with self._failing("stat", rel):
            return bool(self.fs.exists(self._abs(rel)))

    def is_dir(self, rel: str) -> bool:
        with self._failing("stat", rel):
            return bool(self.fs.isdir(self._abs(rel)))

    def list_dir(self, rel: str) -> list[str]:
        return sorted({name.split("/")[0] for name, _ in self._ls(rel)})

    def _find(self, rel: str) -> dict[str, Any]:
        """Every file at or under ``rel``, by path, with fsspec's ``info`` (none when absent)."""
        path = self._abs(rel).rstrip("/")
        found = {}
        with self._failing("list", rel), suppress(FileNotFoundError):
            found = self.fs.find(path, detail=True)
        found = {str(p).rstrip("/"): info for p, info in found.items()}
        return {p: info for p, info in found.items() if p == path or p.startswith(f"{path}/")}

    def modified_at(self, rel: str) -> float | None:
        known = [t for info in self._find(rel).values() if (t := _mtime(info)) is not None]
        return max(known, default=None)

    def walk_files(self, rel: str) -> Iterator[str]:
        prefix = self._abs(rel).rstrip("/") + "/"
        yield from sorted(p.removeprefix(prefix) for p in self._find(rel) if p.startswith(prefix))

    def entries_holding(self, member: str, *, unless: str | None = None) -> list[str]:
        if not self.object_store:
            return super().entries_holding(member, unless=unless)
        # One recursive listing (a request per 1,000 keys), not a request per entry.
        top = [p.split("/") for p in self.walk_files("") if p.count("/") == 1]
        held = {entry for entry, name in top if name == member}
        return sorted(held - {entry for entry, name in top if name == unless})

    def makedirs(self, rel: str) -> None:
        # On an object store, no directories: a prefix exists once a key is under it. s3fs's
        # makedirs would create a missing bucket, with default settings, which must not happen.
        if not self.object_store:
            with self._failing("mkdir", rel):
                self.fs.makedirs(self._abs(rel), exist_ok=True)

    def remove_tree(self, rel: str) -> None:
        # On an object store, the key ``rel`` and every key under ``rel/``: never the bucket.
        keys = list(self._find(rel)) if self.object_store else []
        with self._failing("remove", rel), suppress(FileNotFoundError):
            if keys:
                self.fs.rm(keys)
            elif not self.object_store and self.fs.exists(self._abs(rel)):
                self.fs.rm(self._abs(rel), recursive=True)


def write_buffer_bytes(backend: Backend) -> int | None:
    """The most host bytes one ``open_write`` file of the backend under any wrappers holds in
    part buffers (docs/s3.md, "Memory"): 0 for a backend that writes straight to files, None
    where fsspec buffers unseen."""
    backend = unwrapped(backend)
    if isinstance(backend, FsspecBackend) and backend.s3:
        return upload_buffer_bytes(block_size_of(backend._target), backend._parts_in_flight)
    return None if getattr(backend, "object_store", False) else 0


def _create_once(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """One conditional create: True when made, False when refused (the object exists)."""
    try:
        fs.pipe_file(path, data, mode="create")
    except OSError as exc:
        # A 412 that s3fs did not map to FileExistsError (some S3-compatible servers leave out
        # the ``Condition`` field s3fs keys on).
        code, status = s3_error(exc)
        if (
            isinstance(exc, FileExistsError)
            or status == 412
            or code in ("PreconditionFailed", "412")
        ):
            return False
        raise
    return True


def _mtime(info: dict[str, Any]) -> float | None:
    """A file's modification time from fsspec's ``info``: ``LastModified`` (object stores),
    ``mtime`` (local) or ``created`` (memory)."""
    for field in ("LastModified", "mtime", "created"):
        value = info.get(field)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _discard(f: Any) -> None:
    """Drop a half-written fsspec file without publishing it: ``discard()`` aborts s3fs's
    multipart upload (if one was started); marking the file closed keeps ``close()`` and
    ``__del__`` from flushing what is left."""
    discard = getattr(f, "discard", None)
    if callable(discard):
        # If the abort itself fails, the upload stays open but invisible; a bucket lifecycle
        # rule (AbortIncompleteMultipartUpload) reclaims it.
        with suppress(Exception):
            discard()
    with suppress(AttributeError):
        f.closed = True
