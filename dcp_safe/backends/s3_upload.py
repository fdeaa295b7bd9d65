"""S3 multipart uploads: a write-behind upload through s3fs, with a bounded number of parts in
flight, and the sweep of incomplete ones.

Each open file owns at most ``parts_in_flight + 1`` reused block buffers
(:func:`upload_buffer_bytes`, which a caller counts against its memory budget; docs/s3.md,
"Memory"): a full block goes to a part thread while the next one fills, and ``write()`` waits
when every thread is busy. A file under one block is a single ``PutObject``. Several parts at
once, because one leaves the link idle while each request is signed and answered.

Nothing is visible until :meth:`S3MultipartWriter.close` completes the upload. Any failure aborts
it after every part in flight has finished, so no part lands on an aborted upload. Every request
names ``ChecksumAlgorithm``, so the server checks each part. A failed part is not retried here:
the writer's retry loop rewrites the whole file.

The sweeper's side (:func:`abort_stale_uploads`): an upload never completed or aborted (a killed
writer) is invisible as an object but billed as storage. Only uploads dcp_safe could have
started are candidates: under the root, with a key of its own layout
(:func:`dcp_safe.layout.is_own_object`); a bucket is shared ground, and another application's
upload is never touched. An upload whose start time the server does not report has no age; it
is aborted only together with its save's prefix (the sweeper found that save abandoned),
otherwise left to the bucket's lifecycle rule.
"""

from __future__ import annotations

import contextlib
import datetime
import io
from collections.abc import Collection
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from dcp_safe import layout
from dcp_safe.backends.backend import Backend, unwrapped
from dcp_safe.choices import require_int
from dcp_safe.errors import StorageError

MIN_PART_BYTES = 5 * 2**20  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's largest part number
DEFAULT_PARTS_IN_FLIGHT = 4
_DEFAULT_BLOCK = 50 * 2**20  # s3fs's default_block_size
# Named on every request, so that the server checks each part.
_CHECKSUM = {"ChecksumAlgorithm": "CRC32"}
_CHECKSUM_FIELD = "ChecksumCRC32"
# s3fs's per-file transfer concurrency option, read as this writer's parts in flight.
_CONCURRENCY_OPTION = "max_concurrency"


def block_size_of(fs: Any) -> int:
    # The part size: ``default_block_size`` (or ``blocksize``), at least S3's 5 MiB.
    size = getattr(fs, "default_block_size", None) or getattr(fs, "blocksize", None)
    return max(int(size or _DEFAULT_BLOCK), MIN_PART_BYTES)


def parts_in_flight_of(fs: Any) -> int:
    """The parts one upload to ``fs`` keeps in flight: ``max_concurrency`` when the caller set
    it in ``storage_options`` (a ConfigError unless an int >= 1), else
    :data:`DEFAULT_PARTS_IN_FLIGHT` (not s3fs's 10: ten 50 MiB blocks per open file is more than
    a writer with several files open should hold unasked)."""
    options = getattr(fs, "storage_options", None) or {}
    value = options.get(_CONCURRENCY_OPTION, DEFAULT_PARTS_IN_FLIGHT)
    return require_int(f"parts in flight ({_CONCURRENCY_OPTION} in storage_options)", value, 1)


def upload_buffer_bytes(block_size: int, parts_in_flight: int) -> int:
    # Every part in flight plus the block filling (the first block grows as it fills, so
    # CPython may reserve up to an eighth more for it).
    return (parts_in_flight + 1) * block_size


class _BlockBody(io.BytesIO):
    """A read-only file over a block, without copying it into a buffer of its own.

    botocore turns a ``bytes`` body into ``io.BytesIO`` but sends a ``bytearray`` as is, which
    aiohttp writes in one go from the event loop (and warns about, past 1 MiB). Being a
    ``BytesIO`` keeps aiohttp's in-loop chunked path (no executor hop per chunk); every read is
    served from the block itself.
    """

    def __init__(self, block: bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(block).cast("B")
        self._at = 0

    def read(self, size: int | None = -1, /) -> bytes:
        left = self._view.nbytes - self._at
        chunk = self._view[self._at : self._at + (left if size is None or size < 0 else size)]
        self._at += chunk.nbytes
        return bytes(chunk)

    read1 = read

    def readinto(self, buffer: Any, /) -> int:
        with memoryview(buffer).cast("B") as target:
            chunk = self._view[self._at : self._at + target.nbytes]
            target[: chunk.nbytes] = chunk
            self._at += chunk.nbytes
            return chunk.nbytes

    def seek(self, pos: int, whence: int = 0, /) -> int:
        base = {0: 0, 1: self._at, 2: self._view.nbytes}[whence]
        if base + pos < 0:
            raise ValueError(f"negative seek position {base + pos}")
        self._at = base + pos
        return self._at

    def tell(self) -> int:
        return self._at

    def getbuffer(self) -> memoryview:
        return self._view[:]

    def getvalue(self) -> bytes:
        return bytes(self._view)

    def _read_only(self, *args: Any) -> Any:
        raise io.UnsupportedOperation("a block body is read-only")

    write = truncate = _read_only

    def close(self) -> None:
        self._view.release()
        super().close()


class S3MultipartWriter:
    """One object (``bucket/key`` on ``fs``, anything with ``call_s3`` and ``split_path``)
    written as a pipelined multipart upload of ``block_size`` parts, or one PUT if it stays
    small.

    Call order: ``write()`` any number of times, then ``close()`` (complete) or ``abort()``
    (drop), from one thread. The part threads are this object's own. A failed ``write()`` or
    ``close()`` aborts the upload before it raises.
    """

    def __init__(
        self, fs: Any, path: str, block_size: int, *, parts_in_flight: int = DEFAULT_PARTS_IN_FLIGHT
    ) -> None:
        self.parts_in_flight = parts_in_flight
        self._fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.block_size = block_size
        self._buf = bytearray()  # the block filling; grows until the first part is sent
        self._free: list[bytearray] = []  # blocks whose part is sent, for reuse
        self._fill = 0  # bytes of the current block holding data
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []  # every part sent, in order
        self._in_flight: dict[Future[dict[str, Any]], bytearray] = {}
        # Its threads start with the first part: a single-PUT file starts none.
        self._pool = ThreadPoolExecutor(parts_in_flight, thread_name_prefix="dcp-safe-s3-part")
        self.peak_buffer_bytes = 0  # the most block bytes held at once
        self.closed = False
        self.url = f"s3://{self.bucket}/{self.key}"

    @property
    def buffer_bytes(self) -> int:
        return sum(map(len, [self._buf, *self._free, *self._in_flight.values()]))

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on a closed S3 upload")
        try:
            self._collect(None)  # a failed part's error, once known
            with memoryview(data) as raw, raw.cast("B") as view:
                done = 0
                while done < view.nbytes:
                    take = min(view.nbytes - done, self.block_size - self._fill)
                    # In place in a full-size block; the first block grows (a slice at its end).
                    self._buf[self._fill : self._fill + take] = view[done : done + take]
                    self._fill += take
                    done += take
                    if self._fill == self.block_size:
                        self._send_block()
        except BaseException:
            self.abort()
            raise
        self._pos += done
        return done

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._collect(None)
            if self._upload_id is None:
                self._call("put_object", Body=_BlockBody(self._last_block()), **_CHECKSUM)
            else:
                if self._fill:
                    self._send_block()
                self._collect(ALL_COMPLETED)
                self._call(
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": [part.result() for part in self._parts]},
                )
        except BaseException:
            self.abort()
            raise
        self._release()

    def abort(self) -> None:
        # Cancel the parts not started, wait out the ones being sent, abort it server side.
        if self.closed:
            return
        for future in self._in_flight:
            future.cancel()
        wait(list(self._in_flight))  # a part still running would land on the aborted upload
        if self._upload_id is not None:
            # If the abort itself fails the upload stays open but invisible; the sweeper
            # (abort_stale_uploads) or a bucket lifecycle rule reclaims it.
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self._upload_id)
        self._release()

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return dict(self._fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs))

    def _last_block(self) -> bytearray:
        del self._buf[self._fill :]
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        return self._buf

    def _collect(self, return_when: str | None) -> None:
        # Free the blocks of the parts finished (after waiting, if ``return_when`` says for
        # what) and raise the first failure among them.
        if return_when is not None and self._in_flight:
            wait(list(self._in_flight), return_when=return_when)
        for future in [f for f in self._in_flight if f.done()]:
            self._free.append(self._in_flight.pop(future))
            if (error := future.exception()) is not None:
                raise error

    def _send_block(self) -> None:
        if self._upload_id is None:
            out = self._call("create_multipart_upload", **_CHECKSUM)
            self._upload_id = str(out["UploadId"])
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise StorageError(
                "write", self.url, f"more than {MAX_PARTS} parts: raise the block size"
            )
        while len(self._in_flight) >= self.parts_in_flight:
            self._collect(FIRST_COMPLETED)
        body = self._buf if self._fill == self.block_size else self._last_block()
        future = self._pool.submit(self._upload_part, self._upload_id, number, body)
        self._parts.append(future)
        self._in_flight[future] = body
        # A block is allocated only when none is free, so at most parts_in_flight + 1 exist;
        # at full size at once (the file is multipart now), so it never grows by reallocation.
        self._buf = self._free.pop() if self._free else bytearray(self.block_size)
        self._fill = 0
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)

    def _upload_part(self, upload_id: str, number: int, body: bytearray) -> dict[str, Any]:
        try:
            with _BlockBody(body) as f:
                out = self._call(
                    "upload_part", UploadId=upload_id, PartNumber=number, Body=f, **_CHECKSUM
                )
        except Exception as exc:
            raise StorageError("write", self.url, f"part {number}: {exc}") from exc
        part: dict[str, Any] = {"PartNumber": number, "ETag": out["ETag"]}
        if _CHECKSUM_FIELD in out:
            part[_CHECKSUM_FIELD] = out[_CHECKSUM_FIELD]
        return part

    def _release(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True)
        self._buf = bytearray()
        self._free.clear()
        self._in_flight.clear()


def is_bucket_root(backend: Backend) -> bool:
    # The root is a whole bucket (``s3://bucket``), not a prefix in one.
    backend = unwrapped(backend)
    root = str(getattr(backend, "root", "")).strip("/")
    return bool(getattr(backend, "object_store", False)) and bool(root) and "/" not in root


def incomplete_uploads(backend: Backend) -> list[dict[str, Any]]:
    # Incomplete multipart uploads whose key lies under the backend's root (S3 only).
    backend = unwrapped(backend)
    fs = getattr(backend, "fs", None)
    if fs is None or not hasattr(fs, "list_multipart_uploads"):
        return []
    bucket, _, prefix = str(backend.root).partition("/")  # type: ignore[attr-defined]
    uploads: list[dict[str, Any]] = fs.list_multipart_uploads(bucket)
    prefix = f"{prefix}/" if prefix else ""
    return [dict(u, Bucket=bucket) for u in uploads if str(u.get("Key", "")).startswith(prefix)]


def abort_stale_uploads(
    backend: Backend,
    *,
    older_than_s: float,
    now: float,
    dry_run: bool = False,
    in_progress: Collection[str] = (),
    collected: Collection[str] = (),
    uploads: list[dict[str, Any]] | None = None,
    only: str | None = None,
) -> tuple[str, ...]:
    """Abort dcp_safe's uploads under the root started more than ``older_than_s`` before
    ``now``; return the ``s3://bucket/key`` of each (in a dry run, that would be).

    ``in_progress``: names with a save known to be live (kept whatever their age);
    ``collected``: names whose abandoned save the caller is removing (aborted even without a
    start time); ``uploads``: the candidates (:func:`incomplete_uploads` when None); ``only``:
    the one name whose uploads are candidates.
    """
    backend = unwrapped(backend)
    aborted = []
    root_prefix = str(backend.root).partition("/")[2]  # type: ignore[attr-defined]
    for upload in incomplete_uploads(backend) if uploads is None else uploads:
        rel = str(upload["Key"]).removeprefix(root_prefix).lstrip("/")
        name = rel.split("/", 1)[0]
        if not layout.is_own_object(rel) or name in in_progress or only not in (None, name):
            continue
        initiated = upload.get("Initiated")
        if isinstance(initiated, datetime.datetime):
            if now - initiated.timestamp() < older_than_s:
                continue
        elif name not in collected:
            continue  # no age: only with its abandoned save's prefix
        if not dry_run:
            backend.fs.call_s3(  # type: ignore[attr-defined]
                "abort_multipart_upload",
                Bucket=upload["Bucket"],
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )
        aborted.append(f"s3://{upload['Bucket']}/{upload['Key']}")
    return tuple(aborted)
