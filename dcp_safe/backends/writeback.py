"""Writeback started early: a streamed file's pages go to the disk while it is still written.

A durable write ends in ``fsync``, which waits for every dirty page of the file to reach the
disk. Left alone, the kernel starts writing a file back only when its dirty-page thresholds are
crossed, so the fsync of a freshly written 256 MiB shard waited about 0.4 s for I/O that could
have run while the shard was being written. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts the
writeback of a range and returns without waiting for it (what RocksDB's ``bytes_per_sync``
does); issued every few MiB, it leaves the closing fsync little to wait for. It promises nothing
about durability: the fsync still does that, and still runs.

Measured on this project's 2-core host (ext4 on a virtual disk; plain ``os.write`` of float32
tensors then ``fsync``, 6 rounds, order rotated): 256 MiB took 0.587 s with no early writeback,
0.467 s starting it every 8 MiB and 0.61 s every 32 MiB; 1 GiB took 2.168, 1.850 and 1.847 s.

Linux only (glibc's ``sync_file_range``). Elsewhere, or where a file system refuses it (the first
failure turns it off for that file), files are written exactly as before.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable

__all__ = ["WRITEBACK_STEP_BYTES", "WritebackFile", "early_writeback_available"]

#: Bytes written between two writeback requests.
WRITEBACK_STEP_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def _load() -> Callable[[int, int, int, int], int] | None:
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func  # type: ignore[no-any-return]


_sync_file_range = _load()


def early_writeback_available() -> bool:
    """Whether this platform can start writeback early (Linux with glibc)."""
    return _sync_file_range is not None


class WritebackFile:
    """A new file's buffered writer that starts writeback of every ``step`` bytes written.

    Args:
        file: the file, opened for writing at offset 0 (a new file).
        step: bytes between two writeback requests.
    """

    def __init__(self, file: io.BufferedWriter, step: int = WRITEBACK_STEP_BYTES) -> None:
        self._file = file
        self._step = step
        self._written = 0
        self._started = 0  # writeback was requested for [0, _started)
        self._enabled = _sync_file_range is not None

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        count = self._file.write(data)
        self._written += count
        if self._enabled and self._written - self._started >= self._step:
            self._start_writeback()
        return count

    def tell(self) -> int:
        return self._written

    def _start_writeback(self) -> None:
        assert _sync_file_range is not None
        self._file.flush()  # the buffered tail must be in the page cache to be written back
        length = self._written - self._started
        if _sync_file_range(self._file.fileno(), self._started, length, _SYNC_FILE_RANGE_WRITE):
            # Refused here (a file system without it): the closing fsync does all the work, as
            # it would without this class.
            self._enabled = False
        self._started = self._written
