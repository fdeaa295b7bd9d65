"""The safetensors layout as plain functions: shard plan, names, header, dtype parsing.

The header written by hand is checked against the reference reader in the round-trip tests
(tests/exporting/test_export.py); here, the arithmetic on its own, with no checkpoint.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from dcp_safe.errors import ConfigError
from dcp_safe.exporting.consolidate import TensorEntry, parse_dtype
from dcp_safe.exporting.formats import (
    encode_header,
    encode_index,
    plan_shards,
    shard_names,
)


def _entry(key: str, numel: int, dtype: torch.dtype = torch.float32) -> TensorEntry:
    return TensorEntry(key=key, shape=(numel,), dtype=dtype, out_dtype=dtype)


def test_shards_fill_up_to_the_limit_and_a_large_tensor_stands_alone() -> None:
    entries = [_entry("a", 10), _entry("b", 10), _entry("big", 100), _entry("c", 5)]
    shards = plan_shards(entries, max_shard_bytes=80)  # 40 + 40 fit; 400 does not
    assert [[e.key for e in shard] for shard in shards] == [["a", "b"], ["big"], ["c"]]


def test_one_shard_is_a_plain_model_safetensors() -> None:
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3)[-1] == "model-00003-of-00003.safetensors"


def test_header_offsets_are_contiguous_and_the_data_section_aligned() -> None:
    entries = [_entry("x", 3), _entry("y", 0), _entry("z", 2, torch.bfloat16)]
    raw = encode_header(entries, {"format": "pt"})
    (length,) = struct.unpack("<Q", raw[:8])
    assert length == len(raw) - 8 and length % 8 == 0
    header = json.loads(raw[8:])
    assert header["x"]["data_offsets"] == [0, 12]
    assert header["y"]["data_offsets"] == [12, 12]
    assert header["z"] == {"dtype": "BF16", "shape": [2], "data_offsets": [12, 16]}
    assert header["__metadata__"] == {"format": "pt"}


def test_the_index_maps_every_key_and_totals_the_tensor_bytes() -> None:
    files = {"one": [_entry("a", 4)], "two": [_entry("b", 2, torch.float16)]}
    index = json.loads(encode_index(files))
    assert index == {"metadata": {"total_size": 20}, "weight_map": {"a": "one", "b": "two"}}


def test_dtype_names_parse_and_non_floating_ones_are_refused() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float32) is torch.float32
    assert parse_dtype(None) is None
    assert parse_dtype("float") is torch.float32  # torch.float is float32's alias
    for bad in ("int8", "nope", "Size", torch.int64):
        with pytest.raises(ConfigError):
            parse_dtype(bad)
