"""A write-behind multipart upload to S3 through s3fs: one part in flight while the next fills.

Each open file owns at most two block buffers, reused: ``write()`` copies the caller's bytes
into the current block (the caller may reuse its buffer as soon as ``write()`` returns), and a
full block is handed, as is, to one background thread that sends it with ``UploadPart`` while
the other block fills. A file smaller than one block is sent with a single ``PutObject``.

Nothing is visible until :meth:`S3MultipartWriter.close` completes the upload. Any failure (a
part's upload, surfaced on the next ``write()`` or at ``close()``) aborts the upload: a failed
upload is never completed. Every request names ``ChecksumAlgorithm`` (CRC32 by default), so the
server checks each part, and the completion lists each part's checksum.

A part that fails is not retried here beyond what the s3fs client itself does: the error is
raised and the caller (the writer's retry loop) rewrites the whole file.
"""

from __future__ import annotations

import contextlib
import io
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["MAX_PARTS", "MIN_PART_BYTES", "S3MultipartWriter", "block_size_of"]

MIN_PART_BYTES = 5 * 2**20  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's largest part number
_DEFAULT_BLOCK = 50 * 2**20  # s3fs's default_block_size


def block_size_of(fs: Any) -> int:
    """The part size for ``fs``: its ``default_block_size`` (or ``blocksize``), at least 5 MiB."""
    size = getattr(fs, "default_block_size", None) or getattr(fs, "blocksize", None)
    return max(int(size or _DEFAULT_BLOCK), MIN_PART_BYTES)


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
        end = (
            self._view.nbytes
            if size is None or size < 0
            else min(self._at + size, self._view.nbytes)
        )
        start, self._at = self._at, max(end, self._at)
        return bytes(self._view[start:end])

    def read1(self, size: int | None = -1, /) -> bytes:
        return self.read(size)

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

    def write(self, data: Any, /) -> int:
        raise io.UnsupportedOperation("a block body is read-only")

    def truncate(self, size: int | None = None, /) -> int:
        raise io.UnsupportedOperation("a block body is read-only")

    def close(self) -> None:
        self._view.release()
        super().close()


class S3MultipartWriter:
    """One object written as a pipelined multipart upload (or one PUT, if it stays small).

    Args:
        fs: an ``s3fs.S3FileSystem`` (anything with ``call_s3`` and ``split_path``).
        path: ``bucket/key``.
        block_size: bytes per part; every part but the last is exactly this size.
        checksum_algorithm: named on every request (``None``: none named).
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        block_size: int,
        checksum_algorithm: str | None = "CRC32",
    ) -> None:
        if block_size < MIN_PART_BYTES:
            raise ValueError(f"block_size {block_size} is below S3's {MIN_PART_BYTES}-byte part")
        self._fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.block_size = block_size
        self.checksum_algorithm = checksum_algorithm
        self._bufs: list[bytearray] = [bytearray()]  # the second one only once a part is sent
        self._cur = 0
        self._fill = 0  # bytes of the current block holding data
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []  # completed parts, in order
        self._pending: Future[dict[str, Any]] | None = None
        self._pool: ThreadPoolExecutor | None = None  # started with the first part
        self._error: BaseException | None = None
        self.closed = False

    # ------------------------------------------------------------------ the file API

    def tell(self) -> int:
        return self._pos

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        """Copy ``data`` into the current block; send the block once it is full."""
        self._check_open()
        self._raise_background_error()
        with memoryview(data) as raw, raw.cast("B") as view:
            n = view.nbytes
            done = 0
            while done < n:
                buf = self._bufs[self._cur]
                take = min(n - done, self.block_size - self._fill)
                chunk = view[done : done + take]
                if len(buf) == self._fill:
                    buf += chunk  # a block not yet at full size grows
                else:
                    buf[self._fill : self._fill + take] = chunk  # a reused block: in place
                self._fill += take
                done += take
                self._pos += take
                if self._fill == self.block_size:
                    self._send_block()
        return n

    def close(self) -> None:
        """Complete the upload (or PUT a small file); on any failure, abort and re-raise."""
        if self.closed:
            return
        self._raise_background_error()
        try:
            if self._upload_id is None:
                body = self._last_block()
                self._call("put_object", Body=_BlockBody(body), **self._checksum_kw())
            else:
                if self._fill:
                    self._send_block()
                self._wait_pending()
                self._call(
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
        except BaseException:
            self.abort()
            raise
        self._release()

    def abort(self) -> None:
        """Drop the upload: wait out the part in flight, then abort it server side. Quiet."""
        if self.closed:
            return
        if self._pending is not None:
            with contextlib.suppress(BaseException):
                self._pending.result()
            self._pending = None
        if self._upload_id is not None:
            # If the abort itself fails the upload stays open but invisible; the sweeper
            # (storage.multipart) or a bucket lifecycle rule reclaims it.
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            self._upload_id = None
        self._release()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on a closed S3 upload")

    def _raise_background_error(self) -> None:
        """Re-raise a failed part's error (once it is known), after aborting the upload."""
        if self._error is None and self._pending is not None and self._pending.done():
            self._error = self._pending.exception()
        if self._error is not None:
            error = self._error
            self.abort()
            raise error

    def _checksum_kw(self) -> dict[str, Any]:
        return {"ChecksumAlgorithm": self.checksum_algorithm} if self.checksum_algorithm else {}

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = self._fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        return out

    def _last_block(self) -> bytearray:
        """The current block cut to its data (in place: it is never filled again)."""
        buf = self._bufs[self._cur]
        del buf[self._fill :]
        return buf

    def _wait_pending(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            self._parts.append(pending.result())
        except BaseException as exc:
            self._error = exc
            raise

    def _send_block(self) -> None:
        """Hand the current block to the background thread and switch to the other one."""
        if self._upload_id is None:
            out = self._call("create_multipart_upload", **self._checksum_kw())
            self._upload_id = str(out["UploadId"])
        self._wait_pending()  # the other block is free again once its part is sent
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise OSError(f"s3://{self.bucket}/{self.key}: more than {MAX_PARTS} parts")
        body = self._bufs[self._cur] if self._fill == self.block_size else self._last_block()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-safe-s3-part")
        self._pending = self._pool.submit(self._upload_part, self._upload_id, number, body)
        self._cur ^= 1
        if len(self._bufs) <= self._cur:
            self._bufs.append(bytearray())
        self._fill = 0

    def _upload_part(self, upload_id: str, number: int, body: bytearray) -> dict[str, Any]:
        with _BlockBody(body) as view:
            out = self._call(
                "upload_part",
                UploadId=upload_id,
                PartNumber=number,
                Body=view,
                **self._checksum_kw(),
            )
        part: dict[str, Any] = {"PartNumber": number, "ETag": out["ETag"]}
        field = f"Checksum{self.checksum_algorithm}" if self.checksum_algorithm else ""
        if field and field in out:
            part[field] = out[field]
        return part

    def _release(self) -> None:
        """Stop the thread and free the blocks."""
        self.closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._bufs.clear()
        self._pending = None
