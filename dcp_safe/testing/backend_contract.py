"""The backend contract: one pytest suite every :class:`~dcp_safe.backends.backend.Backend` passes.

Subclass :class:`BackendContract` in a test module (a class named ``Test...``) and provide a
fresh, empty root per test, either by overriding :meth:`BackendContract.make_backend` or, when
the backend needs other fixtures, by overriding the ``backend`` fixture::

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, tmp_path):
            return MyBackend(str(tmp_path))

Hooks a subclass may override: :meth:`BackendContract.assert_no_pending_uploads` (an object
store checks that a failed write left no multipart upload open), ``hides_open_writes`` (False
where a streamed file is visible while it is being written, e.g. POSIX, whose writer works in a
hidden directory instead) and ``large_write_bytes`` (big enough for a multipart upload).

The tests exercise the protocol only; exclusive-create races run only where the backend claims
``supports_exclusive_create``.
"""

from __future__ import annotations

import pickle
import threading

import pytest

from dcp_safe.backends.backend import Backend
from dcp_safe.errors import CheckpointCorruptError

__all__ = ["BackendContract"]

_RACERS = 8


class _Injected(Exception):
    """Raised inside a ``with`` block to prove nothing is left behind."""


class BackendContract:
    """The contract every backend meets. Not collected itself (its name has no ``Test``)."""

    hides_open_writes: bool = True
    large_write_bytes: int = 3 * 2**20

    def make_backend(self) -> Backend:
        """A backend on a fresh, empty root. Override this or the ``backend`` fixture."""
        raise NotImplementedError("override make_backend() or the backend fixture")

    @pytest.fixture
    def backend(self) -> Backend:
        return self.make_backend()

    def assert_no_pending_uploads(self, backend: Backend) -> None:
        """Fail if an abandoned write left server-side state (an open multipart upload)."""

    # ----------------------------------------------------------------- small files

    def test_write_bytes_round_trips(self, backend: Backend) -> None:
        backend.makedirs("d")
        backend.write_bytes("d/small", b"\x00payload\xff")
        backend.write_bytes("empty", b"")
        assert backend.read_bytes("d/small") == b"\x00payload\xff"
        assert backend.read_bytes("empty") == b""
        assert backend.size("d/small") == 9
        assert backend.size("empty") == 0

    def test_plain_write_bytes_replaces(self, backend: Backend) -> None:
        backend.write_bytes("f", b"old")
        backend.write_bytes("f", b"newer")
        assert backend.read_bytes("f") == b"newer"

    def test_missing_file_raises_file_not_found(self, backend: Backend) -> None:
        with pytest.raises(FileNotFoundError):
            backend.read_bytes("missing")
        with pytest.raises(FileNotFoundError):
            backend.size("missing")
        with pytest.raises(FileNotFoundError), backend.open_read("missing"):
            pass

    def test_open_read_is_seekable(self, backend: Backend) -> None:
        backend.write_bytes("f", bytes(range(100)))
        with backend.open_read("f") as f:
            f.seek(40)
            assert f.read(5) == bytes(range(40, 45))

    # ----------------------------------------------------------------- exclusive create

    def test_exclusive_write_refuses_an_existing_file(self, backend: Backend) -> None:
        backend.write_bytes("marker", b"first", exclusive=True)
        with pytest.raises(FileExistsError):
            backend.write_bytes("marker", b"second", exclusive=True)
        assert backend.read_bytes("marker") == b"first"

    def test_exclusive_write_refuses_a_plainly_written_file(self, backend: Backend) -> None:
        backend.write_bytes("marker", b"plain")
        with pytest.raises(FileExistsError):
            backend.write_bytes("marker", b"exclusive", exclusive=True)
        assert backend.read_bytes("marker") == b"plain"

    def test_exclusive_create_race_has_exactly_one_winner(self, backend: Backend) -> None:
        if not backend.supports_exclusive_create:
            pytest.skip("backend does not claim atomic exclusive create")
        barrier = threading.Barrier(_RACERS)
        outcomes: dict[int, str] = {}

        def race(i: int) -> None:
            barrier.wait()
            try:
                backend.write_bytes("marker", f"racer-{i}".encode(), exclusive=True)
                outcomes[i] = "won"
            except FileExistsError:
                outcomes[i] = "lost"
            except BaseException as exc:  # reported below, not swallowed
                outcomes[i] = repr(exc)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(_RACERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [i for i, outcome in outcomes.items() if outcome == "won"]
        assert sorted(outcomes.values()) == ["lost"] * (_RACERS - 1) + ["won"], outcomes
        assert backend.read_bytes("marker") == f"racer-{winners[0]}".encode()

    # ----------------------------------------------------------------- streamed writes

    def test_streamed_write_is_visible_after_a_clean_exit(self, backend: Backend) -> None:
        with backend.open_write("shard") as f:
            f.write(b"abc")
            f.write(memoryview(b"defg"))
            assert f.tell() == 7
            if self.hides_open_writes:
                assert not backend.exists("shard")
        assert backend.read_bytes("shard") == b"abcdefg"
        assert backend.size("shard") == 7

    def test_empty_streamed_write(self, backend: Backend) -> None:
        with backend.open_write("empty"):
            pass
        assert backend.read_bytes("empty") == b""

    def test_failed_streamed_write_leaves_nothing(self, backend: Backend) -> None:
        backend.makedirs("ckpt")
        with pytest.raises(_Injected), backend.open_write("ckpt/shard") as f:
            f.write(b"partial bytes")
            raise _Injected
        self._assert_gone(backend, "ckpt", "shard")

    def test_failed_large_streamed_write_leaves_nothing(self, backend: Backend) -> None:
        backend.makedirs("ckpt")
        chunk = b"\xab" * 2**20
        with pytest.raises(_Injected), backend.open_write("ckpt/shard") as f:
            for _ in range(self.large_write_bytes // len(chunk)):
                f.write(chunk)
            raise _Injected
        self._assert_gone(backend, "ckpt", "shard")

    def test_large_streamed_write_round_trips(self, backend: Backend) -> None:
        pieces = [bytes([i]) * 2**20 for i in range(self.large_write_bytes // 2**20)]
        with backend.open_write("big") as f:
            for piece in pieces:
                f.write(piece)
        assert backend.size("big") == sum(map(len, pieces))
        assert backend.read_bytes("big") == b"".join(pieces)
        self.assert_no_pending_uploads(backend)

    def _assert_gone(self, backend: Backend, parent: str, name: str) -> None:
        assert not backend.exists(f"{parent}/{name}")
        assert name not in backend.list_dir(parent)
        assert not [p for p in backend.walk_files("") if p.endswith(name)]
        self.assert_no_pending_uploads(backend)

    # ----------------------------------------------------------------- the tree

    def _tree(self, backend: Backend) -> None:
        # A checkpoint's shape under plain names: the contract is about files and folders, and
        # only dcp_safe.layout spells the names dcp_safe gives them (test_architecture).
        for rel in ("ckpt", "ckpt/ranks", "ckpt-other"):
            backend.makedirs(rel)
        for rel in ("ckpt/a.bin", "ckpt/ranks/r0.json", "ckpt/ranks/r1.json", "ckptx"):
            backend.write_bytes(rel, rel.encode())
        backend.write_bytes("ckpt-other/f", b"x")

    def test_exists_and_is_dir(self, backend: Backend) -> None:
        self._tree(backend)
        assert backend.exists("ckpt") and backend.is_dir("ckpt")
        assert backend.exists("ckpt/ranks") and backend.is_dir("ckpt/ranks")
        assert backend.exists("ckpt/a.bin") and not backend.is_dir("ckpt/a.bin")
        assert not backend.exists("nope") and not backend.is_dir("nope")
        assert not backend.exists("ckpt/nope") and not backend.is_dir("ckpt/nope")

    def test_list_dir_names_direct_children(self, backend: Backend) -> None:
        self._tree(backend)
        assert sorted(backend.list_dir("")) == ["ckpt", "ckpt-other", "ckptx"]
        assert sorted(backend.list_dir("ckpt")) == ["a.bin", "ranks"]
        assert sorted(backend.list_dir("ckpt/ranks")) == ["r0.json", "r1.json"]
        assert backend.list_dir("nope") == []
        assert backend.list_dir("ckpt/a.bin") == []

    def test_list_dir_of_an_empty_root(self, backend: Backend) -> None:
        assert backend.list_dir("") == []

    def test_walk_files(self, backend: Backend) -> None:
        self._tree(backend)
        assert sorted(backend.walk_files("ckpt")) == [
            "a.bin",
            "ranks/r0.json",
            "ranks/r1.json",
        ]
        assert sorted(backend.walk_files("")) == [
            "ckpt-other/f",
            "ckpt/a.bin",
            "ckpt/ranks/r0.json",
            "ckpt/ranks/r1.json",
            "ckptx",
        ]
        assert list(backend.walk_files("nope")) == []

    def test_sizes_lists_the_files_directly_under_a_folder(self, backend: Backend) -> None:
        self._tree(backend)
        assert backend.sizes("ckpt") == {"a.bin": len(b"ckpt/a.bin")}
        assert backend.sizes("ckpt/ranks") == {
            "r0.json": len(b"ckpt/ranks/r0.json"),
            "r1.json": len(b"ckpt/ranks/r1.json"),
        }
        assert backend.sizes("") == {"ckptx": len(b"ckptx")}
        assert backend.sizes("nope") == {}
        assert backend.sizes("ckptx") == {}  # a file is no folder

    def test_sizes_sees_a_file_written_after_an_earlier_listing(self, backend: Backend) -> None:
        backend.makedirs("ckpt")
        backend.write_bytes("ckpt/a", b"1")
        assert backend.sizes("ckpt") == {"a": 1}
        backend.write_bytes("ckpt/b", b"22")
        with backend.open_write("ckpt/c") as f:
            f.write(b"333")
        backend.write_bytes("ckpt/a", b"")
        assert backend.sizes("ckpt") == {"a": 0, "b": 2, "c": 3}

    def test_read_small_reads_a_file_within_its_cap_and_refuses_more(
        self, backend: Backend
    ) -> None:
        backend.makedirs("d")
        backend.write_bytes("d/f", b"x" * 100)
        backend.write_bytes("d/empty", b"")
        assert backend.read_small("d/f", 100) == b"x" * 100
        assert backend.read_small("d/f", 1 << 20) == b"x" * 100
        assert backend.read_small("d/empty", 10) == b""
        with pytest.raises(CheckpointCorruptError, match="over the 99-byte limit"):
            backend.read_small("d/f", 99)
        with pytest.raises(FileNotFoundError):
            backend.read_small("d/missing", 100)
        with pytest.raises(FileNotFoundError):
            backend.read_small("d/f/under", 100)

    def test_read_small_refuses_a_folder(self, backend: Backend) -> None:
        backend.makedirs("d/sub")
        backend.write_bytes("d/sub/f", b"x")
        with pytest.raises(CheckpointCorruptError, match="a directory"):
            backend.read_small("d/sub", 100)

    def test_makedirs_is_idempotent(self, backend: Backend) -> None:
        backend.makedirs("a/b")
        backend.makedirs("a/b")
        backend.makedirs("")
        backend.write_bytes("a/b/f", b"1")
        assert backend.read_bytes("a/b/f") == b"1"

    def test_remove_tree_removes_everything_under_it_and_nothing_else(
        self, backend: Backend
    ) -> None:
        self._tree(backend)
        backend.remove_tree("ckpt")
        assert not backend.exists("ckpt") and not backend.is_dir("ckpt")
        assert not backend.exists("ckpt/ranks/r0.json")
        assert sorted(backend.list_dir("")) == ["ckpt-other", "ckptx"]
        assert backend.read_bytes("ckptx") == b"ckptx"
        assert backend.read_bytes("ckpt-other/f") == b"x"

    def test_remove_tree_of_a_file_and_of_nothing(self, backend: Backend) -> None:
        self._tree(backend)
        backend.remove_tree("ckptx")
        backend.remove_tree("nope")
        backend.remove_file("ckpt/a.bin")
        backend.remove_file("ckpt/nope")
        assert not backend.exists("ckptx")
        assert sorted(backend.list_dir("ckpt")) == ["ranks"]

    # ----------------------------------------------------------------- the object itself

    def test_full_path_names_the_root(self, backend: Backend) -> None:
        assert backend.full_path("") == backend.url
        assert backend.full_path("ckpt/f").startswith(backend.url.rstrip("/"))
        assert backend.full_path("ckpt/f").endswith("/ckpt/f")

    def test_backend_survives_pickling(self, backend: Backend) -> None:
        backend.write_bytes("f", b"before")
        clone: Backend = pickle.loads(pickle.dumps(backend))
        assert clone.read_bytes("f") == b"before"
        clone.write_bytes("g", b"after")
        assert backend.read_bytes("g") == b"after"

    def test_concurrent_writes_to_different_paths(self, backend: Backend) -> None:
        backend.makedirs("ckpt")
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:
                with backend.open_write(f"ckpt/shard_{i}") as f:
                    f.write(bytes([i]) * 1000)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert sorted(backend.list_dir("ckpt")) == [f"shard_{i}" for i in range(4)]
        for i in range(4):
            assert backend.read_bytes(f"ckpt/shard_{i}") == bytes([i]) * 1000
