"""The POSIX backend: streamed writes vanish on failure, publish never clobbers unless asked."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import FsspecBackend
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.errors import CheckpointCorruptError, StorageError


def test_a_failed_streamed_write_leaves_nothing(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    with pytest.raises(RuntimeError), backend.open_write("shard") as f:
        f.write(b"partial bytes")
        raise RuntimeError("serializer failed")
    assert not (tmp_path / "shard").exists()


def test_streamed_write_refuses_to_replace_an_existing_file(tmp_path: Path) -> None:
    (tmp_path / "shard").write_bytes(b"old")
    backend = LocalBackend(str(tmp_path))
    with pytest.raises(StorageError), backend.open_write("shard") as f:
        f.write(b"new")
    assert (tmp_path / "shard").read_bytes() == b"old"


def test_exclusive_small_write_is_exclusive(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    backend.write_bytes("marker", b"a", exclusive=True)
    with pytest.raises(FileExistsError):
        backend.write_bytes("marker", b"b", exclusive=True)
    assert backend.read_bytes("marker") == b"a"


@pytest.mark.parametrize("exclusive", [False, True])
def test_a_small_file_appears_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exclusive: bool
) -> None:
    # Ranks poll a folder for each other's reports and markers and read one as soon as its name
    # is listed: a name that showed before its bytes were written read as empty JSON.
    backend = LocalBackend(str(tmp_path))
    halfway, resume = threading.Event(), threading.Event()
    write = os.write

    def slow_write(fd: int, data: bytes | memoryview) -> int:
        if threading.current_thread().name == "writer" and not halfway.is_set():
            halfway.set()
            written = write(fd, bytes(data[:1]))
            resume.wait(30)
            return written
        return write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)
    writer = threading.Thread(
        target=backend.write_bytes,
        args=("report", b'{"rank": 1}'),
        name="writer",
        kwargs={"exclusive": exclusive},
    )
    writer.start()
    try:
        assert halfway.wait(30)
        assert "report" not in backend.list_dir("")  # only a hidden temporary so far
    finally:
        resume.set()
        writer.join(30)
    assert backend.read_bytes("report") == b'{"rank": 1}'
    assert backend.list_dir("") == ["report"]  # the temporary is gone
    with pytest.raises(FileExistsError):
        backend.write_bytes("report", b"other", exclusive=True)
    assert backend.read_bytes("report") == b'{"rank": 1}' and backend.list_dir("") == ["report"]


def _dir(root: Path, name: str, content: bytes) -> None:
    (root / name).mkdir()
    (root / name / "f").write_bytes(content)


def test_publish_moves_a_directory_into_place(tmp_path: Path) -> None:
    _dir(tmp_path, ".a.partial-1", b"new")
    assert LocalBackend(str(tmp_path)).publish_dir(".a.partial-1", "a", replace=False) is None
    assert (tmp_path / "a" / "f").read_bytes() == b"new"
    assert not (tmp_path / ".a.partial-1").exists()


def test_publish_never_replaces_without_being_asked(tmp_path: Path) -> None:
    _dir(tmp_path, "a", b"old")
    _dir(tmp_path, ".a.partial-1", b"new")
    with pytest.raises(FileExistsError):
        LocalBackend(str(tmp_path)).publish_dir(".a.partial-1", "a", replace=False)
    assert (tmp_path / "a" / "f").read_bytes() == b"old"


def test_publish_with_replace_swaps_and_hands_back_the_old_one(tmp_path: Path) -> None:
    _dir(tmp_path, "a", b"old")
    _dir(tmp_path, ".a.partial-1", b"new")
    backend = LocalBackend(str(tmp_path))
    parked = backend.publish_dir(".a.partial-1", "a", replace=True)
    assert (tmp_path / "a" / "f").read_bytes() == b"new"
    assert parked is not None and (tmp_path / parked / "f").read_bytes() == b"old"


def test_listing_and_walking(tmp_path: Path) -> None:
    _dir(tmp_path, "a", b"x")
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "g").write_bytes(b"y")
    backend = LocalBackend(str(tmp_path))
    assert backend.list_dir("") == ["a"]
    assert backend.list_dir("missing") == []
    assert sorted(backend.walk_files("a")) == ["f", "sub/g"]


def _special_files(root: Path) -> None:
    os.mkfifo(root / "fifo.distcp")
    (root / "zero.distcp").symlink_to("/dev/zero")
    (root / "dir.distcp").mkdir()
    (root / "ok.distcp").write_bytes(b"data")


@pytest.mark.timeout(60)  # a guard: before the fix, opening the FIFO waited forever
@pytest.mark.parametrize("make", [LocalBackend, lambda root: FsspecBackend(f"file://{root}")])
def test_open_read_refuses_what_is_not_a_regular_file(tmp_path: Path, make: object) -> None:
    """A data file (a shard) that is a FIFO, a device or a directory is refused at once as
    corrupt, never waited on or read without end; through fsspec as well as directly."""
    _special_files(tmp_path)
    backend: Backend = make(str(tmp_path))  # type: ignore[operator]
    # LocalBackend follows no link beneath its root: the link to /dev/zero is refused as one.
    zero = "symbolic link" if isinstance(backend, LocalBackend) else "device"
    for name, kind in [("fifo", "FIFO"), ("zero", zero), ("dir", "directory")]:
        with pytest.raises(CheckpointCorruptError, match=kind), backend.open_read(f"{name}.distcp"):
            pass
    with backend.open_read("ok.distcp") as f:
        assert f.read() == b"data"
    with pytest.raises(FileNotFoundError), backend.open_read("missing.distcp"):
        pass


def test_sizes_leaves_out_links_folders_and_special_files(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path), fsync=False)
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert backend.sizes("") == {"f": 3}


def test_read_small_refuses_a_file_over_its_cap_before_reading_it(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path), fsync=False)
    (tmp_path / "big").write_bytes(b"x" * 5000)
    with pytest.raises(CheckpointCorruptError, match="5000 bytes, over the 4999-byte limit"):
        backend.read_small("big", 4999)
    assert backend.read_small("big", 5000) == b"x" * 5000
