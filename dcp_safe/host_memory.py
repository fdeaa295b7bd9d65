"""Reading this host's memory, or its binding cgroup's, from ``/proc`` and the cgroup files.

The cgroup this process is charged to (v2 first, then v1), the tightest limit on it or its
ancestors, and the memory that limit leaves: inside a container the OOM killer acts on the
cgroup's charge, which ``/proc/meminfo`` does not show. Roots are parameters, so tests and
containers can name their own mount points.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything this large is no limit.
_NO_LIMIT_BYTES = 1 << 60
# The limit file, the usage file and the name of each cgroup version.
_V2_FILES = ("memory.max", "memory.current", "v2")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "v1")


def _memberships(text: str) -> tuple[str | None, str | None]:
    """``(v2 path, v1 memory path)`` of this process's cgroups, from ``/proc/self/cgroup``.

    Each path is relative to its hierarchy's root; inside a container with its own cgroup
    namespace it is ``/``, so the root's files are this cgroup's.
    """
    rows = [f for f in (line.split(":", 2) for line in text.splitlines()) if len(f) == 3]
    v2 = next((path for hid, ctls, path in rows if hid == "0" and ctls == ""), None)
    return v2, next((path for _, ctls, path in rows if "memory" in ctls.split(",")), None)


def _read_text(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# -- the limit and what it leaves (the staging budget, the fallback) ----------------------------


def read_host(
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> tuple[int, str, int]:
    """``(usable_bytes, source, available_bytes)`` of this host or its binding cgroup, now.

    Usable RAM is the tightest memory limit on this process's cgroup (v2, else v1) or its
    ancestors when it is below ``MemTotal``, else ``MemTotal``; available is then the smaller
    of the cgroup's headroom (``limit - usage + inactive_file``) and psutil's ``available``,
    never negative.
    """
    import psutil

    vm = psutil.virtual_memory()
    usable, source, available = int(vm.total), "MemTotal", int(vm.available)
    root = Path(cgroup_root)
    v2_rel, v1_rel = _memberships(_read_text(proc_self_cgroup))
    v2 = [] if v2_rel is None else _self_and_ancestors(root, v2_rel)
    v1 = _self_and_ancestors(root / "memory", v1_rel or "/")
    candidates = [(d, *_V2_FILES) for d in v2] + [(d, *_V1_FILES) for d in v1]
    headroom: int | None = None
    for directory, limit_name, usage_name, version in candidates:
        limit = _read_int(directory / limit_name)
        if limit is None or limit >= min(usable, _NO_LIMIT_BYTES):
            continue  # no limit, or not the tightest one yet
        usage = _read_int(directory / usage_name)
        headroom = None if usage is None else limit - usage + _inactive_file(directory)
        usable, source = limit, f"cgroup {version} {limit_name} at {directory}"
    if headroom is not None:
        available = min(available, headroom)
    return usable, source, max(0, available)


def available_bytes_now(
    *,
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> int:
    """Memory available to this node (or container) now, as :func:`read_host` finds it: a
    node-wide figure, to compare with a budget's ``node_reserve``, not the per-rank ``reserve``.
    """
    return read_host(cgroup_root, proc_self_cgroup)[2]


def _read_int(path: Path) -> int | None:
    text = _read_text(path).strip()
    return int(text) if text.isdigit() else None


def _inactive_file(directory: Path) -> int:
    # Inactive page cache is reclaimable, so it counts as available, as MemAvailable does.
    for line in _read_text(directory / "memory.stat").splitlines():
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
            return int(value)
    return 0


def _self_and_ancestors(root: Path, rel: str) -> list[Path]:
    parts = [p for p in rel.strip("/").split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


# -- the usage files (telemetry) ----------------------------------------------------------------


@dataclass(frozen=True)
class CgroupFiles:
    """The memory files of this process's cgroup (``None`` where there is none)."""

    current: str | None
    peak: str | None


def find_cgroup_files(proc_root: str, cgroup_root: str) -> CgroupFiles:
    """Locate this process's cgroup usage files: v2 first, then v1 (each in this process's own
    cgroup, else in the hierarchy's root, as inside a container's cgroup namespace)."""
    v2_rel, v1_rel = _memberships(_read_text(os.path.join(proc_root, "self", "cgroup")))
    for rel, root, usage, peak in (
        (v2_rel, Path(cgroup_root), "memory.current", "memory.peak"),
        (v1_rel, Path(cgroup_root, "memory"), "memory.usage_in_bytes", "memory.max_usage_in_bytes"),
    ):
        if rel is None:
            continue
        folders = _self_and_ancestors(root, rel)
        base = folders[0] if folders[0].is_dir() else folders[-1]
        if (base / usage).exists():
            peak_path = base / peak
            return CgroupFiles(str(base / usage), str(peak_path) if peak_path.exists() else None)
    return CgroupFiles(None, None)
