"""ListedSizes: each folder listed once; a name a listing lacks is asked for on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_safe.backends.listed_sizes import ListedSizes
from dcp_safe.backends.local_backend import LocalBackend


class _Counted(LocalBackend):
    """A local root that records its listings and lone size calls, and can hide a name."""

    def __init__(self, root: Path, hide: str | None = None) -> None:
        super().__init__(str(root))
        self.listed: list[str] = []
        self.sized: list[str] = []
        self.hide = hide

    def sizes(self, rel: str) -> dict[str, int]:
        self.listed.append(rel)
        return {k: v for k, v in super().sizes(rel).items() if k != self.hide}

    def size(self, rel: str) -> int:
        self.sized.append(rel)
        return super().size(rel)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "ckpt" / "_ranks").mkdir(parents=True)
    (tmp_path / "ckpt" / "a.distcp").write_bytes(b"x" * 10)
    (tmp_path / "ckpt" / "b.distcp").write_bytes(b"x" * 20)
    (tmp_path / "ckpt" / "_ranks" / "rank_00000.json").write_bytes(b"{}")
    return tmp_path


def test_every_file_is_sized_from_one_listing_of_its_folder(tree: Path) -> None:
    backend = _Counted(tree)
    sizes = ListedSizes(backend, "ckpt")
    found = [sizes.size(p) for p in ("a.distcp", "b.distcp", "_ranks/rank_00000.json")]
    assert found == [10, 20, 2]
    assert backend.listed == ["ckpt", "ckpt/_ranks"]
    assert backend.sized == []


def test_a_name_the_listing_lacks_is_asked_for_before_it_is_called_missing(tree: Path) -> None:
    backend = _Counted(tree, hide="b.distcp")
    sizes = ListedSizes(backend, "ckpt")
    assert sizes.size("b.distcp") == 20
    assert backend.sized == ["ckpt/b.distcp"]
    with pytest.raises(FileNotFoundError):
        sizes.size("gone.distcp")


def test_folders_listed_ahead_are_not_listed_again(tree: Path) -> None:
    backend = _Counted(tree)
    sizes = ListedSizes(backend, "ckpt", listed={"": {"a.distcp": 10}})
    assert sizes.size("a.distcp") == 10
    assert sizes.size("b.distcp") == 20  # a gap in the given listing: asked for on its own
    assert backend.listed == []
    assert backend.sized == ["ckpt/b.distcp"]
    assert sizes.path("b.distcp") == "ckpt/b.distcp"
