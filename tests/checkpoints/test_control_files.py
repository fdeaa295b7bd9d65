"""Control files are read strictly: stat first, regular files under a cap, typed JSON.

Whoever can write a root can put a directory, a FIFO, a device or a huge file where a marker,
a manifest, a lease or the history should be. Each is refused with ``CheckpointCorruptError``
without blocking or reading it whole, and one bad entry never hides the good ones.
(``tests/e2e/test_hostile_corpus.py`` runs the same attacks through every entry point.)
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.catalog import list_checkpoints
from dcp_safe.checkpoints.committed import open_committed, resolve_name
from dcp_safe.checkpoints.history import HISTORY_FILE, History
from dcp_safe.checkpoints.node_cache import NODE_COMMITTED_MARKER, list_node_caches
from dcp_safe.commit.lease import lease_acquired_at
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest import limits


def _bounded(call: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """``call()`` on a thread; fail (rather than hang the suite) if it blocks."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "blocked"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _save(root: Path, step: int) -> str:
    name = f"step_{step}"
    writer = SafeStorageWriter(root, step=step, options=WriterOptions(fsync=False))
    dcp_safe.save({"w": torch.full((4,), float(step))}, checkpoint_id=name, storage_writer=writer)
    return name


# ---------------------------------------------------------------------------- read_small


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> Backend:
    return open_backend(str(tmp_path) if request.param == "local" else memory_root)


def test_read_small_reads_a_regular_file_within_its_cap(backend: Backend) -> None:
    backend.makedirs("d")
    backend.write_bytes("d/f", b"x" * 100)
    assert backend.read_small("d/f", 100) == b"x" * 100
    with pytest.raises(CheckpointCorruptError, match="over the 99-byte limit"):
        backend.read_small("d/f", 99)
    with pytest.raises(CheckpointCorruptError, match="a directory"):
        backend.read_small("d", 100)
    with pytest.raises(FileNotFoundError):
        backend.read_small("d/missing", 100)


def test_a_fifo_or_a_device_is_refused_without_blocking(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    # The link to /dev/zero is refused as a link: nothing beneath a local root is followed.
    for rel, kind in (("fifo", "FIFO, a device or a socket"), ("zero", "a symbolic link")):
        with pytest.raises(CheckpointCorruptError, match=kind):
            _bounded(lambda rel=rel: backend.read_small(rel, 1 << 20))

        def open_it(rel: str = rel) -> None:
            with backend.open_read(rel):
                pass

        with pytest.raises(CheckpointCorruptError, match="not a regular file"):
            _bounded(open_it)


# ---------------------------------------------------------------------------- committed


def _marker(root: Path, name: str) -> Path:
    return root / name / layout.COMMITTED_MARKER


@pytest.mark.parametrize("damage", ["dir", "fifo", "huge", "dev_zero"])
def test_a_marker_that_is_no_small_file_is_corrupt_and_hides_nothing(
    tmp_path: Path, damage: str
) -> None:
    good, bad = _save(tmp_path, 1), _save(tmp_path, 2)
    marker = _marker(tmp_path, bad)
    marker.unlink()
    if damage == "dir":
        marker.mkdir()
    elif damage == "fifo":
        os.mkfifo(marker)
    elif damage == "huge":
        with open(marker, "wb") as f:
            f.truncate(64 << 20)  # sparse: refused by its size, never read
    else:
        marker.symlink_to("/dev/zero")
    backend = open_backend(str(tmp_path))
    with pytest.raises(CheckpointCorruptError, match=layout.COMMITTED_MARKER):
        _bounded(lambda: open_committed(backend, bad))
    damaged: list[str] = []
    listed = _bounded(lambda: list_checkpoints(tmp_path, on_damaged=lambda n, e: damaged.append(n)))
    assert [info.name for info in listed] == [good] and damaged == [bad]
    assert _bounded(lambda: resolve_name(backend, layout.LATEST)) == good


def test_a_manifest_over_its_cap_is_refused_by_its_size(tmp_path: Path) -> None:
    name = _save(tmp_path, 1)
    with open(tmp_path / name / layout.MANIFEST, "r+b") as f:
        f.truncate(limits.MANIFEST_MAX_BYTES + 1)
    with pytest.raises(CheckpointCorruptError, match="byte limit"):
        open_committed(open_backend(str(tmp_path)), name)


def test_list_checkpoints_logs_a_damaged_entry_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    (tmp_path / bad / layout.MANIFEST).write_bytes(b"[" * 100_000)
    assert [info.name for info in list_checkpoints(tmp_path)] == ["step_1"]
    assert f"{bad} is damaged" in caplog.text


# ---------------------------------------------------------------------------- history


def _event(name: str, step: int) -> bytes:
    line = {"event": "committed", "name": name, "step": step, "tier": "local", "time": 1.0}
    return json.dumps(line).encode() + b"\n"


def test_history_lines_outside_the_schema_are_skipped(tmp_path: Path) -> None:
    (tmp_path / HISTORY_FILE).write_bytes(
        _event("step_1", 1)
        + b'{"event": "committed", "tier": "local", "validated": true}\n'  # no name
        + b'{"event": "committed", "name": ["x"], "step": 1, "time": 1.0}\n'
        + b'{"event": "committed", "name": "a", "step": "1", "time": 1.0}\n'
        + b'{"event": "committed", "name": "a", "step": 1, "time": NaN}\n'
        + b'{"event": "committed", "name": "a", "step": 1, "time": 1.0, "validated": "yes"}\n'
        + b"[" * 50_000
        + b"\n"
        + _event("step_2", 2)
    )
    history = History(open_backend(str(tmp_path)))
    assert [e["name"] for e in history.read()] == ["step_1", "step_2"]
    assert history.validated_names() == set()


def test_a_history_that_is_not_a_file_reads_as_empty_and_refuses_appends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.mkfifo(tmp_path / HISTORY_FILE)
    history = History(open_backend(str(tmp_path)))
    assert _bounded(history.read) == []
    assert "unreadable" in caplog.text
    with pytest.raises(CheckpointCorruptError, match="not a regular file"):
        _bounded(lambda: history.append("requested", 1, "step_1"))


def test_only_the_newest_part_of_an_oversized_history_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dcp_safe.checkpoints.history.HISTORY_MAX_BYTES", 1000)
    lines = b"".join(_event(f"step_{i}", i) for i in range(100))
    (tmp_path / HISTORY_FILE).write_bytes(lines)
    events = History(open_backend(str(tmp_path))).read()
    assert 0 < len(events) < 100
    assert events[-1]["name"] == "step_99"
    assert [e["step"] for e in events] == list(range(100 - len(events), 100))


# ---------------------------------------------------------------------------- leases, caches


@pytest.mark.parametrize(
    "lease",
    [b"not json", b'{"acquired_at": NaN}', b'{"acquired_at": "now"}', b"[1]", b"[" * 100_000],
)
def test_an_unreadable_lease_has_no_time(tmp_path: Path, lease: bytes) -> None:
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / layout.WRITING_LEASE).write_bytes(lease)
    assert lease_acquired_at(open_backend(str(tmp_path)), "step_1") is None


def test_a_lease_that_is_a_fifo_has_no_time_and_blocks_nothing(tmp_path: Path) -> None:
    (tmp_path / "step_1").mkdir()
    os.mkfifo(tmp_path / "step_1" / layout.WRITING_LEASE)
    assert _bounded(lambda: lease_acquired_at(open_backend(str(tmp_path)), "step_1")) is None


def test_a_node_cache_whose_marker_is_no_file_is_left_out(tmp_path: Path) -> None:
    for entry, make in (("a", os.mkfifo), ("b", os.mkdir)):
        (tmp_path / entry).mkdir()
        make(tmp_path / entry / NODE_COMMITTED_MARKER)
    assert _bounded(lambda: list_node_caches(tmp_path)) == []
