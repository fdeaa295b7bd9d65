"""Every item decodes within what the checkpoint declares, into tensors made of its own bytes.

A root writer replaces one item (and re-checksums everything, as they can): a tensor built by a
legacy constructor (uninitialized heap memory), an allocation bomb, a DEFLATE record, a zstd
item that inflates past its declared size. Each is refused, typed, by a load and by deep
verification alike, with the process's memory bounded; and the process goes on saving and
loading exactly afterwards.
"""

from __future__ import annotations

import io
import pickle
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_items import (
    Call,
    call_pickle,
    replace_item,
    tensor_pickle,
    torch_archive,
    zstd,
    zstd_zeros,
)
from support import assert_state_equal, blank_like, make_state

import dcp_safe
from dcp_safe import CheckpointCorruptError, SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.errors import UnsafeCheckpointError

NAME = "step_1"


def _save(root: Path, *, compression: str = "none", seed: int = 1) -> dict[str, Any]:
    state = make_state(seed)
    writer = SafeStorageWriter(root, options=WriterOptions(compression=compression, fsync=False))
    dcp_safe.save(state, checkpoint_id=NAME, storage_writer=writer, no_dist=True)
    return state


def _load(root: Path, state: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(state)
    reader = SafeStorageReader(root)
    dcp_safe.load(target, checkpoint_id=NAME, storage_reader=reader, no_dist=True)
    return target


def _refused_everywhere(root: Path, state: dict[str, Any], error: type[Exception]) -> str:
    with pytest.raises(error) as loading:
        _load(root, state)
    with pytest.raises(error) as verifying:
        dcp_safe.verify_checkpoint(root, NAME)
    assert type(loading.value) is type(verifying.value)
    return str(loading.value)


def _still_sound(tmp_path: Path) -> None:
    """After a refused load, this process saves and loads exactly (nothing was poisoned)."""
    root = tmp_path / "after"
    state = _save(root, seed=9)
    assert_state_equal(_load(root, state), state)
    dcp_safe.verify_checkpoint(root, NAME)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


LEGACY = {
    "FloatTensor(n)": call_pickle(torch.FloatTensor, 1000),
    "UntypedStorage(n)": call_pickle(torch.UntypedStorage, 1000),
    "rebuild over UntypedStorage(n)": call_pickle(
        torch._utils._rebuild_tensor_v2,
        Call(torch.UntypedStorage, 64),  # a constructor call, not a record of the item
        0,
        (16,),
        (1,),
        False,
        __import__("collections").OrderedDict(),
    ),
}


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_an_object_item_made_by_a_legacy_constructor_is_refused(tmp_path: Path, case: str) -> None:
    """torch's weights-only unpickler admits these: a restored state held uninitialized heap."""
    root = tmp_path / "root"
    state = _save(root)
    replace_item(root, NAME, "extra.tag", None, torch_archive(LEGACY[case]))
    message = _refused_everywhere(root, state, UnsafeCheckpointError)
    assert "extra.tag" in message
    _still_sound(tmp_path)


def test_a_tensor_item_made_by_a_legacy_constructor_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = _save(root)
    # Padded to the 512 bytes 16x8 float32 take: the metadata's own check passes.
    legacy = torch_archive(call_pickle(torch.FloatTensor, 16, 8), {"pad": bytes(1024)})
    replace_item(root, NAME, "f32", [0, 0], legacy)
    assert "f32" in _refused_everywhere(root, state, UnsafeCheckpointError)
    _still_sound(tmp_path)


def test_an_allocation_bomb_in_an_object_item_is_refused(tmp_path: Path) -> None:
    """About 800 bytes that asked for 256 MiB (``bytearray(n)``)."""
    root = tmp_path / "root"
    state = _save(root)
    bomb = torch_archive(call_pickle(bytearray, 1 << 28))
    assert len(bomb) < 1024
    replace_item(root, NAME, "extra.tag", None, bomb)
    before = _peak_rss_bytes()
    _refused_everywhere(root, state, UnsafeCheckpointError)
    assert _peak_rss_bytes() - before < 128 << 20
    _still_sound(tmp_path)


def test_a_deflated_record_is_refused_before_it_inflates(tmp_path: Path) -> None:
    """A tensor item whose storage record is DEFLATE: 256 KiB stored, 256 MiB inflated; the
    pickle views 16x8 of it, so torch's reader loaded it quietly (and verify never looked)."""
    root = tmp_path / "root"
    state = _save(root)
    item = torch_archive(
        tensor_pickle((16, 8), numel=1 << 26), zeros={"data/0": 1 << 28}, deflate={"data/0"}
    )
    assert len(item) < 1 << 20
    replace_item(root, NAME, "f32", [0, 0], item)
    before = _peak_rss_bytes()
    assert "compressed" in _refused_everywhere(root, state, UnsafeCheckpointError)
    assert _peak_rss_bytes() - before < 128 << 20
    _still_sound(tmp_path)


def test_a_zstd_tensor_item_that_inflates_past_its_declared_size_is_refused(
    tmp_path: Path,
) -> None:
    """f32 is 16x8 (512 bytes); its item now inflates to 256 MiB of zeros (8 KiB stored)."""
    root = tmp_path / "root"
    state = _save(root, compression="zstd")
    replace_item(root, NAME, "f32", [0, 0], zstd_zeros(1 << 28))
    before = _peak_rss_bytes()
    assert "decompresses to more" in _refused_everywhere(root, state, UnsafeCheckpointError)
    assert _peak_rss_bytes() - before < 128 << 20
    _still_sound(tmp_path)


def test_a_zstd_object_item_past_the_object_budget_is_refused(tmp_path: Path) -> None:
    """A plain object (an int) beside 512 MiB of padding, compressed to a few KiB: the
    weights-only check loaded it whole, in load and in verify."""
    root = tmp_path / "root"
    state = _save(root, compression="zstd")
    padded = torch_archive(pickle.dumps(5, protocol=2), zeros={"pad": 1 << 29})
    replace_item(root, NAME, "extra.tag", None, zstd(padded))
    del padded
    assert "decompresses to more" in _refused_everywhere(root, state, UnsafeCheckpointError)
    _still_sound(tmp_path)


def test_a_tensor_item_of_another_shape_than_declared_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = _save(root)
    other = io.BytesIO()
    torch.save(torch.zeros(4, 4), other)
    replace_item(root, NAME, "f32", [0, 0], other.getvalue())
    assert "dtype and shape" in _refused_everywhere(root, state, CheckpointCorruptError)


def test_every_entry_type_dcp_writes_decodes(tmp_path: Path) -> None:
    """Plain tensors of every dtype torch.save writes, BytesIO, plain data and tensors inside
    plain data: decoded by the item decoder itself, exactly."""
    from dcp_safe.checkpoints.items import decode_object, decode_tensor_item

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8]
    dtypes += [torch.uint16, torch.float8_e4m3fn, torch.complex64, torch.float64]
    for dtype in dtypes:
        tensor = torch.arange(12).reshape(3, 4).to(dtype)
        for value in (tensor, tensor.t()):
            out = io.BytesIO()
            torch.save(value, out)
            decoded = decode_tensor_item(
                bytearray(out.getvalue()), dtype=dtype, shape=tuple(value.shape), path="p", item="i"
            )
            assert decoded.stride() == value.stride(), dtype
            raw = decoded.contiguous().view(torch.uint8)
            assert torch.equal(raw, value.contiguous().view(torch.uint8)), dtype
    blob = io.BytesIO(b"opaque \x00 bytes")
    blob.seek(3)
    plain = {"a": [1, 2.5, "x", (1, 2), {3}, b"yy", None, True, complex(1, 2)]}
    plain["t"] = [torch.arange(5), torch.Size([2, 3]), torch.device("cpu"), torch.float16]
    for value in (blob, plain, bytearray(b"ab"), frozenset({1})):
        out = io.BytesIO()
        torch.save(value, out)
        decoded = decode_object(out.getvalue(), "p", "i")
        if isinstance(value, io.BytesIO):
            assert decoded.getvalue() == value.getvalue() and decoded.tell() == 3
        elif isinstance(value, dict):
            assert decoded["a"] == value["a"] and torch.equal(decoded["t"][0], value["t"][0])
            assert decoded["t"][1:] == value["t"][1:]
        else:
            assert decoded == value


def _nested_list(depth: int) -> bytes:
    """A list nested ``depth`` deep, as a pickle builds it without recursion (EMPTY_LIST
    ``depth`` times, then APPEND): what ``torch.save`` could never write past ~900."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


NESTED = {
    "500 deep": _nested_list(500),
    "100,000 deep": _nested_list(100_000),
    "a list holding itself": b"\x80\x02]q\x00h\x00a.",
}


@pytest.mark.parametrize("pickled", NESTED.values(), ids=NESTED.keys())
def test_an_object_nested_past_the_bound_is_refused_by_verify_and_load_alike(
    tmp_path: Path, pickled: bytes
) -> None:
    """Was: deep verify "OK", and every load a ``RecursionError`` (re-serializing the value
    for DCP recurses where unpickling did not)."""
    state = _save(tmp_path)
    replace_item(tmp_path, NAME, "extra.tag", None, torch_archive(pickled))
    message = _refused_everywhere(tmp_path, state, UnsafeCheckpointError)
    assert "item extra.tag" in message and ("levels deep" in message or "itself" in message)
    _still_sound(tmp_path)


def test_an_object_nested_to_the_bound_loads_and_verifies(tmp_path: Path) -> None:
    state = _save(tmp_path)
    replace_item(tmp_path, NAME, "extra.tag", None, torch_archive(_nested_list(100)))
    dcp_safe.verify_checkpoint(tmp_path, NAME)
    value = _load(tmp_path, state)["extra"]["tag"]
    for _ in range(99):
        (value,) = value
    assert value == []
