"""Helpers shared by the tests, by job: ``states`` (state dicts, load targets, exact
comparisons), ``faults`` (writers that fail, die or stall on purpose), ``tamper`` (editing a
committed checkpoint as a root writer can), ``scripts`` (a script loaded as a module) and
``counting`` (what a test says must not happen in this process).

The names most tests use are re-exported here, so ``from support import make_state`` works.
"""

from __future__ import annotations

from .counting import checkpoint_workers, manifest_parses, ready_worker
from .scripts import load_script
from .states import (
    assert_state_equal,
    blank_like,
    blank_tree,
    differing_tensors,
    gather_full,
    make_state,
    rank_union,
    shard_rows,
)
from .tamper import claim_item_length, flip_item_byte, resign_manifest

__all__ = [
    "assert_state_equal",
    "blank_like",
    "blank_tree",
    "checkpoint_workers",
    "claim_item_length",
    "differing_tensors",
    "flip_item_byte",
    "gather_full",
    "load_script",
    "make_state",
    "manifest_parses",
    "rank_union",
    "ready_worker",
    "resign_manifest",
    "shard_rows",
]
