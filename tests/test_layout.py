"""Checkpoint names: anything that could escape the root or hide itself is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_safe import layout
from dcp_safe.errors import InvalidCheckpointNameError


@pytest.mark.parametrize("name", ["step_000100", "run7-epoch=3", "a.b", "A+B", "_x"])
def test_plain_keys_are_accepted(name: str) -> None:
    assert layout.validate_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "/abs", "a/b", "a\\b", "..", "a..b", ".hidden", "latest", "x" * 201, "tab\t", 7]
)
def test_unsafe_names_are_refused(name: object) -> None:
    with pytest.raises(InvalidCheckpointNameError):
        layout.validate_name(name)


@given(st.text(max_size=40))
def test_an_accepted_name_is_one_plain_visible_path_component(name: str) -> None:
    try:
        layout.validate_name(name)
    except InvalidCheckpointNameError:
        return
    assert "/" not in name and not name.startswith(".") and ".." not in name and name


def test_partial_directories_are_hidden_and_recognisable() -> None:
    partial = layout.partial_dir_name("step_1", layout.new_save_id())
    assert partial.startswith(".") and layout.is_partial_entry(partial)
    assert not layout.is_partial_entry("step_1")


def test_shard_and_rank_manifest_names_follow_dcp_and_the_layout() -> None:
    assert layout.shard_file_name(3, 1) == "__3_1.distcp"
    assert layout.rank_manifest_name(12) == "_ranks/rank_00012.json"
