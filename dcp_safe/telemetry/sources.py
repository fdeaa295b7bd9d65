"""Reading memory figures from ``/proc`` and the cgroup file system, each one optional.

Where the cgroup's files are is :mod:`dcp_safe.host_memory`'s to say. One parser per file, each
returning ``None`` for what it cannot read, never raising. ``/proc`` rather than psutil, because
``memory_full_info`` walks every mapping in ``smaps`` where ``smaps_rollup`` is the kernel's own
summary; psutil is the fallback for RSS where there is no ``/proc`` (macOS).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref

from dcp_safe.host_memory import find_cgroup_files

__all__ = ["ProcReader"]

_KIB = 1024


_READ_BYTES = 1 << 16  # every file read here is a few KiB


class _Files:
    """Files kept open and re-read with ``pread`` at offset 0: a third of the CPU of reopening
    (measured: 0.05 vs 0.16 ms for four ``/proc`` files), which matters every 20 ms."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def read(self, path: str | None) -> str | None:
        if path is None:
            return None
        fd = self._fds.get(path)
        try:
            if fd is None:
                with self._lock:
                    fd = self._fds.get(path)
                    if fd is None:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, _READ_BYTES, 0).decode("ascii", errors="replace")
        except OSError:  # missing, unreadable, or gone: absent now, tried again next time
            return None


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):  # "max", empty
        return None


def _picker(*keys: str) -> re.Pattern[str]:
    return re.compile(rf"^({'|'.join(keys)}):?\s+(\d+)", re.MULTILINE)


# One regex per file, over the whole text: the sampler runs every 20 ms during a save, and
# splitting every line of vmstat (~180 of them) in Python costs more than reading it.
_STATUS = _picker("VmRSS", "VmLck")
_ROLLUP = _picker("Pss", "Private_Clean", "Private_Dirty")
_MEMINFO = _picker("MemAvailable")
_VMSTAT = _picker("pswpin", "pswpout")


def _fields(text: str | None, pattern: re.Pattern[str], unit: int = 1) -> dict[str, int]:
    """The ``key[:] value`` lines ``pattern`` picks, as ints times ``unit``."""
    if not text:
        return {}
    return {key: int(value) * unit for key, value in pattern.findall(text)}


class ProcReader:
    """Reads this process's and the host's memory figures under ``proc_root``."""

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.proc_root = proc_root
        self._self = os.path.join(proc_root, "self")
        self.cgroup = find_cgroup_files(proc_root, cgroup_root)
        self._psutil_fallback = proc_root == "/proc" and not os.path.isdir(self._self)
        self._files = _Files()

    def read(self, *, rollup: bool = True) -> dict[str, int | None]:
        """Every figure now; ``None`` for those this host does not expose.

        Args:
            rollup: also read PSS and USS from ``smaps_rollup``; costly and it stalls a save's
                page faults, so read it rarely (docs/telemetry.md, "The memory sampler").
        """
        status = _fields(self._files.read(os.path.join(self._self, "status")), _STATUS, _KIB)
        rollup_text = self._files.read(os.path.join(self._self, "smaps_rollup")) if rollup else None
        rollup_fields = _fields(rollup_text, _ROLLUP, _KIB)
        meminfo = _fields(self._files.read(os.path.join(self.proc_root, "meminfo")), _MEMINFO, _KIB)
        vmstat = _fields(self._files.read(os.path.join(self.proc_root, "vmstat")), _VMSTAT)
        private = [rollup_fields.get(k) for k in ("Private_Clean", "Private_Dirty")]
        return {
            "rss_bytes": status.get("VmRSS", self._rss_fallback()),
            "pss_bytes": rollup_fields.get("Pss"),
            "uss_bytes": None if None in private else sum(p or 0 for p in private),
            "cgroup_current_bytes": _int(self._files.read(self.cgroup.current)),
            "cgroup_peak_bytes": _int(self._files.read(self.cgroup.peak)),
            "host_available_bytes": meminfo.get("MemAvailable"),
            "swap_in_pages": vmstat.get("pswpin"),
            "swap_out_pages": vmstat.get("pswpout"),
            "major_faults": self._major_faults(),
            "locked_bytes": status.get("VmLck"),
        }

    def _major_faults(self) -> int | None:
        text = self._files.read(os.path.join(self._self, "stat"))
        if text is None:
            return None
        fields = text.rpartition(")")[2].split()  # the command name may hold spaces
        try:
            return int(fields[9])
        except (IndexError, ValueError):
            return None

    def _rss_fallback(self) -> int | None:
        if not self._psutil_fallback:
            return None
        import psutil

        return int(psutil.Process().memory_info().rss)
