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
    "name",
    [
        "",
        "/abs",
        "a/b",
        "a\\b",
        "..",
        "a..b",
        ".hidden",
        "latest",
        "x" * 201,
        "tab\t",
        "step_1\n",
        7,
    ],
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
    assert name.isprintable()  # no newline a listing would print as two rows


def test_partial_directories_are_hidden_and_recognisable() -> None:
    partial = layout.partial_dir_name("step_1", layout.new_save_id())
    assert partial.startswith(".") and layout.is_partial_entry(partial)
    assert not layout.is_partial_entry("step_1")


def test_shard_and_rank_manifest_names_follow_dcp_and_the_layout() -> None:
    assert layout.shard_file_name(3, 1) == "__3_1.distcp"
    assert layout.rank_manifest_name(12) == "_ranks/rank_00012.json"


def test_markers_and_takeover_records_are_debris_of_the_layout_and_nothing_else_is() -> None:
    save_id = layout.new_save_id()
    debris = [
        layout.lease_file_name(),
        layout.lease_file_name(save_id),
        layout.takeover_record_name(save_id),
        layout.commit_failure_marker_name(save_id),
        layout.rank_failure_marker_name(3, save_id),
        layout.rank_skip_marker_name(12, save_id),
        layout.rank_report_name(5, save_id),
    ]
    for member in debris:
        assert layout.is_debris(member) and layout.is_own_object(f"step_1/{member}"), member
    assert layout.rank_of_marker(layout.rank_skip_marker_name(12, save_id)) == 12
    assert layout.rank_of_marker(layout.rank_failure_marker_name(3, save_id).split("/")[1]) == 3
    for member in (
        "__0_0.distcp",
        "_ranks/rank_00000.json",
        "_FAILED-",
        "_TAKEOVER-a/b",
        "_ranks/rank_1.failed-x",
        "notes/_FAILED-x",
        "_ranks/rank_00001.skipped-x\n",
    ):
        assert not layout.is_debris(member), member
    assert layout.rank_of_marker("rank_00001.json") is None
    with pytest.raises(ValueError):
        layout.rank_skip_marker_name(1, "../x")


def test_an_assignment_file_is_hidden_beside_the_checkpoints_and_one_path_component() -> None:
    path = layout.assignment_file_name("step_1", "run/../x-3-1")
    assert path == ".step_1.assigned-run_.._x-3-1" and "/" not in path
    assert not layout.is_valid_name(path) and not layout.is_partial_entry(path)
    with pytest.raises(InvalidCheckpointNameError):
        layout.assignment_file_name("../x", "k")


@pytest.mark.parametrize("rank", [0, 3, 12, 99999, 100000, 123456])
def test_a_rank_manifest_name_reads_back_as_its_rank(rank: int) -> None:
    name = layout.rank_manifest_name(rank)
    assert layout.rank_of_manifest(name) == rank
    assert layout.rank_of_manifest(name.rpartition("/")[2]) == rank  # as _ranks/ lists it
    assert layout.is_own_object(f"step_1/{name}")


@pytest.mark.parametrize(
    "entry",
    [
        "rank_0001.json",
        "rank_00001.json\n",
        "rank_00001.jsonx",
        "xrank_00001.json",
        "rank_0000\u0661.json",  # a digit, but not an ASCII one
        "_ranks/rank_00001.failed-x",
        "notes/rank_00001.json",
    ],
)
def test_anything_else_is_no_rank_manifest(entry: str) -> None:
    assert layout.rank_of_manifest(entry) is None


def test_attempt_records_are_named_and_read_back_in_one_place() -> None:
    assert layout.attempts_dir("job 7/a") == "_ATTEMPTS/job_7_a"
    assert len(layout.attempts_dir("x" * 300)) == len("_ATTEMPTS/") + 100
    assert layout.attempt_record_name(2) == "attempt_000000002"
    for number in (0, 2, 10**9 - 1):
        assert layout.attempt_of_record(layout.attempt_record_name(number)) == number
    for entry in ("attempt_2", "attempt_000000002\n", "attempt_000000002.tmp", "x_000000002"):
        assert layout.attempt_of_record(entry) is None


def test_the_other_names_dcp_safe_writes_are_the_layout_s() -> None:
    """Pinned: a checkpoint, history or export written by an earlier version stays readable."""
    assert layout.HISTORY_FILE == "_history.jsonl"
    assert layout.NODE_COMMITTED_MARKER == "_NODE_COMMITTED"
    temp = layout.temp_file_name("manifest.json")
    assert temp.startswith(".manifest.json.tmp-") and len(temp) == len(".manifest.json.tmp-") + 32
    assert temp != layout.temp_file_name("manifest.json")
    assert layout.export_work_dir_name("out", "ab12") == ".out.export-ab12"
    assert layout.safetensors_shard_name(1, 3) == "model-00001-of-00003.safetensors"
    assert (layout.SAFETENSORS_FILE, layout.SAFETENSORS_INDEX, layout.TORCH_FILE) == (
        "model.safetensors",
        "model.safetensors.index.json",
        "model.pt",
    )
    assert layout.EXPORT_CHECKSUMS == "SHA256SUMS"
