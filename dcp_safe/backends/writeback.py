"""Writeback started early: a streamed file's pages go to the disk while it is still written.

``sync_file_range(SYNC_FILE_RANGE_WRITE)`` every few MiB starts the writeback without waiting
(as RocksDB's ``bytes_per_sync``), so the closing ``fsync`` waits for the tail only; that fsync
still makes the file durable. Measurements: docs/benchmarks.md, "Durable commit against the raw
write floor". Linux only; elsewhere, or once a file system refuses it for a file, files are
written exactly as before.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable

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
