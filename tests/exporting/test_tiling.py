"""Export refuses a tensor whose chunks do not tile it exactly (issue 43, finding 9).

Adding up element counts let two overlapping chunks hide a gap of the same size, and the gap
was exported as whatever the freshly allocated tensor held. The checkpoint here is edited as a
root writer can: tensor ``w`` of 16 rows declared as two chunks of 8 rows at rows 0 and 4 (96
elements either way), the second being ``v``'s item re-keyed; everything re-checksummed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import resign_manifest

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageWriter, WriterOptions

NAME = "step_0001"


def _overlapping(root: Path) -> None:
    state = {"w": torch.randn(8, 6), "v": torch.randn(8, 6)}
    dcp_safe.save(
        state,
        checkpoint_id=NAME,
        storage_writer=SafeStorageWriter(root, options=WriterOptions(fsync=False)),
    )

    def edit(raw: dict[str, Any]) -> None:
        for item in raw["items"]:
            if item["fqn"] == "v":
                item["fqn"], item["offset"] = "w", [4, 0]
        plain = raw["dcp_metadata"]
        entries = dict(plain["entries"])
        entries["w"]["size"] = [16, 6]
        entries["w"]["chunks"] = [[[0, 0], [8, 6]], [[4, 0], [8, 6]]]
        plain["entries"] = [["w", entries["w"]]]
        planner = plain["planner_data"]
        planner["audit"] = [pair for pair in planner["audit"] if pair[0] == "w"]
        planner["paths"] = [pair for pair in planner["paths"] if pair[0] == "w"]

    resign_manifest(root, NAME, edit)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_overlapping_chunks_that_hide_a_gap_are_refused(tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "root"
    _overlapping(root)
    with pytest.raises(
        CheckpointCorruptError, match=r"do not tile.*\[0, 0\] and \[4, 0\] overlap"
    ) as err:
        dcp_safe.export(root, NAME, tmp_path / "out", format=fmt)
    assert err.value.item == "w"
    assert not (tmp_path / "out").exists()
