"""Nothing outside a local root: no read or write of LocalBackend follows a link beneath it.

Each test plants what a writer of the root can plant (a link as a folder on the way, a link as
the file itself, a hard link, a tree thousands of folders deep) beside an "outside" tree, runs
the backend's operations, and checks that the outside tree is byte for byte and time for time
what it was, and that every refusal is typed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deep_trees import make_deep_tree, remove_deep_tree

from dcp_safe.backends.backend import MAX_WALK_DEPTH
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.checkpoints.history import HISTORY_FILE, History
from dcp_safe.commit.fencing import Attempt, register_attempt
from dcp_safe.errors import CheckpointCorruptError, StorageError


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Every entry under ``folder``: (mode, size, mtime_ns, bytes of a file), links unfollowed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for entry in [*dirnames, *filenames]:
            path = Path(dirpath, entry)
            st = os.lstat(path)
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
            found[str(path.relative_to(folder))] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return found


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A tree outside the root: files a planted link may point at."""
    folder = tmp_path / "outside"
    (folder / "dir" / "_ranks").mkdir(parents=True)
    (folder / "victim").write_bytes(b"not a checkpoint's to touch\n")
    (folder / "dir" / "f").write_bytes(b"outside data")
    (folder / "dir" / "_ranks" / "rank_00000.json").write_bytes(b"{}")
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "root"
    folder.mkdir()
    return folder


def _refused(call: Callable[[], Any]) -> None:
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        call()


def test_no_operation_goes_through_a_linked_folder(root: Path, outside: Path) -> None:
    (root / "ckpt").symlink_to(outside / "dir")
    before = _snapshot(outside)
    backend = LocalBackend(str(root))

    def read() -> None:
        with backend.open_read("ckpt/f"):
            pass

    def write() -> None:
        with backend.open_write("ckpt/new") as f:
            f.write(b"x")

    _refused(read)
    _refused(lambda: backend.read_small("ckpt/f", 100))
    _refused(lambda: backend.size("ckpt/f"))
    _refused(lambda: backend.stat("ckpt/f"))
    _refused(lambda: backend.modified_at("ckpt/f"))
    _refused(write)
    _refused(lambda: backend.write_bytes("ckpt/new", b"x"))
    _refused(lambda: backend.write_bytes("ckpt/f", b"x"))
    _refused(lambda: backend.write_bytes("ckpt/_ranks/rank_00000.json", b"x", exclusive=True))
    _refused(lambda: backend.makedirs("ckpt/_ranks/more"))
    _refused(lambda: backend.sync_dir("ckpt"))
    _refused(lambda: backend.remove_tree("ckpt/f"))
    _refused(lambda: backend.publish_dir("ckpt/_ranks", "moved", replace=False))
    assert not backend.exists("ckpt/f") and not backend.is_dir("ckpt")
    assert backend.list_dir("ckpt") == [] and backend.sizes("ckpt") == {}
    assert list(backend.walk_files("ckpt")) == [] and backend.entries_holding("f") == []
    assert backend.stat("ckpt").kind == "link"
    backend.remove_tree("ckpt")  # the link itself goes, and only the link
    assert not (root / "ckpt").is_symlink()
    assert _snapshot(outside) == before


def test_a_link_as_the_file_itself_is_refused_or_replaced_never_followed(
    root: Path, outside: Path
) -> None:
    before = _snapshot(outside)
    backend = LocalBackend(str(root))
    for name in ("a", "b", "c", "d"):
        (root / name).symlink_to(outside / "victim")

    def read() -> None:
        with backend.open_read("a"):
            pass

    def append() -> None:
        with backend.open_append("a"):
            pass

    _refused(read)
    _refused(lambda: backend.read_small("a", 1 << 20))
    _refused(lambda: backend.size("a"))
    _refused(append)
    with pytest.raises(FileExistsError):
        backend.write_bytes("b", b"mine", exclusive=True)
    with pytest.raises(StorageError, match="create failed"), backend.open_write("b"):
        pass
    assert backend.sizes("") == {} and backend.exists("a") and not backend.is_dir("a")
    backend.write_bytes("c", b"mine")  # the link is replaced by a file, not written through
    assert not (root / "c").is_symlink() and (root / "c").read_bytes() == b"mine"
    backend.remove_tree("d")
    assert not os.path.lexists(root / "d")
    assert _snapshot(outside) == before


def test_a_file_with_another_hard_link_is_replaced_never_rewritten(
    root: Path, outside: Path
) -> None:
    os.link(outside / "victim", root / "lease")
    before = _snapshot(outside)
    backend = LocalBackend(str(root))
    backend.write_bytes("lease", b"a new lease")
    assert (root / "lease").read_bytes() == b"a new lease"
    assert _snapshot(outside)["victim"][3] == before["victim"][3]


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_the_history_is_never_appended_to_a_file_outside_the_root(
    root: Path, outside: Path, how: str
) -> None:
    bashrc = outside / "bashrc"
    bashrc.write_bytes(b"# a shell start-up file\n")
    if how == "symlink":
        (root / HISTORY_FILE).symlink_to(bashrc)
    else:
        os.link(bashrc, root / HISTORY_FILE)
    before = _snapshot(outside)
    history = History(LocalBackend(str(root)))
    with pytest.raises(CheckpointCorruptError, match=r"symbolic link|hard links"):
        history.append("failed", 1, "step_1", reason="$(touch pwned)")
    assert history.read() == []
    assert _snapshot(outside) == before


def test_fencing_never_creates_a_record_through_a_linked_attempts_folder(
    root: Path, outside: Path
) -> None:
    (root / "_ATTEMPTS").symlink_to(outside / "dir")
    before = _snapshot(outside)
    with pytest.raises(CheckpointCorruptError, match="_ATTEMPTS: a symbolic link"):
        register_attempt(LocalBackend(str(root)), Attempt(number=1))
    assert _snapshot(outside) == before


@pytest.fixture
def deep(root: Path) -> Iterator[Path]:
    """Where a test plants a deep tree; removed afterwards (pytest's clean-up could not)."""
    yield root / "deep"
    remove_deep_tree(root / "deep")


def test_a_tree_thousands_of_folders_deep_is_refused_typed_never_a_recursion_error(
    root: Path, deep: Path
) -> None:
    make_deep_tree(deep, 3000)
    backend = LocalBackend(str(root))
    with pytest.raises(CheckpointCorruptError, match=f"more than {MAX_WALK_DEPTH} deep"):
        list(backend.walk_files("deep"))
    with pytest.raises(CheckpointCorruptError, match=f"more than {MAX_WALK_DEPTH} deep"):
        backend.modified_at("deep")
    with pytest.raises(CheckpointCorruptError, match=f"more than {MAX_WALK_DEPTH} deep"):
        backend.remove_tree("deep")


def test_a_tree_as_deep_as_the_bound_is_walked_and_removed(root: Path, deep: Path) -> None:
    make_deep_tree(deep, MAX_WALK_DEPTH)
    backend = LocalBackend(str(root))
    assert list(backend.walk_files("deep")) == ["d/" * MAX_WALK_DEPTH + "f"]
    assert backend.modified_at("deep") is not None
    backend.remove_tree("deep")
    assert not (root / "deep").exists()
