"""Issue #28, items 1 and 3, as hostile-corpus cases: DCP's metadata is never unpickled in the
trust path, and every decode is bounded by what the checkpoint declares.

Each function mutates a copy of the corpus's root (``case.root``, two good checkpoints; the
target is ``BAD``, step 2) as anyone who can write it can. ``test_hostile_corpus.py`` runs them
with the rest: every entry point, in a subprocess, under alarms, its peak RSS recorded, and the
process's own save afterwards compared with a fresh process's.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hostile_items import (
    call_pickle,
    memo_shared_metadata,
    outside_metadata,
    pickled_metadata,
    poisoned_metadata,
    replace_item,
    replace_metadata,
    strip_plain_metadata,
    tensor_pickle,
    torch_archive,
    wrong_types_metadata,
    zstd_zeros,
)
from support import make_state, resign_manifest

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions, layout
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import manifest_digest

BAD = "step_000000002"
_TAG = ("extra.tag", None)
_F32 = ("f32", [0, 0])


def _new_style_ignores_metadata(case: Any, data: bytes) -> None:
    """``.metadata`` replaced (re-signed) in a checkpoint with plain metadata: loads never
    read it, so ``latest`` is the target, exactly."""
    replace_metadata(case.root, BAD, data)
    case.latest = (BAD, 2)


def metadata_build_onto_class(case: Any) -> None:
    """``.metadata`` of DCP's own globals whose BUILD replaces ``MetadataIndex.__eq__``."""
    _new_style_ignores_metadata(case, poisoned_metadata(pickled_metadata(case.root, BAD)))


def metadata_relative_path_outside(case: Any) -> None:
    """``.metadata`` places every item in a file outside the root."""
    metadata = outside_metadata(pickled_metadata(case.root, BAD), "../../outside/victim")
    _new_style_ignores_metadata(case, metadata)


def metadata_memo_shared(case: Any) -> None:
    """``.metadata`` whose 4,000 entries share one list of 4,000 chunks."""
    _new_style_ignores_metadata(case, memo_shared_metadata(pickled_metadata(case.root, BAD)))


def _written_before(make: Callable[[Any], bytes], doc: str) -> Callable[[Any], None]:
    """The same ``.metadata``, in a checkpoint without the plain form (as written before):
    refused unless the caller trusts the root, and never unpickled to find out."""

    def mutate(case: Any) -> None:
        replace_metadata(case.root, BAD, make(case))
        strip_plain_metadata(case.root, BAD)

    mutate.__doc__ = doc
    return mutate


def _planted(case: Any) -> bytes:
    import os
    import pickle

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.mkdir, (str(case.sentinel),))

    return pickle.dumps(Planted())


def plain_metadata_wrong_types(case: Any) -> None:
    """The manifest's plain metadata holds a string for a size (re-signed)."""

    def edit(raw: dict[str, Any]) -> None:
        body = next(b for key, b in raw["dcp_metadata"]["entries"] if key == "f32")
        body["size"] = "16x8"

    resign_manifest(case.root, BAD, edit)


def plain_metadata_chunk_past_its_bytes(case: Any) -> None:
    """The plain metadata declares f32 as 2**40 x 8 elements: more than its item can hold."""

    def edit(raw: dict[str, Any]) -> None:
        body = next(b for key, b in raw["dcp_metadata"]["entries"] if key == "f32")
        body["size"] = [1 << 40, 8]
        body["chunks"] = [[[0, 0], [1 << 40, 8]]]

    resign_manifest(case.root, BAD, edit)


def plain_metadata_tensor_declared_huge(case: Any) -> None:
    """The plain metadata declares f32 as 2**62 x 8 elements over its one real chunk."""

    def edit(raw: dict[str, Any]) -> None:
        body = next(b for key, b in raw["dcp_metadata"]["entries"] if key == "f32")
        body["size"] = [1 << 62, 8]

    resign_manifest(case.root, BAD, edit)


def _nested_list(depth: int) -> bytes:
    """A list nested ``depth`` deep, built by a pickle without recursion."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _item(item: tuple[str, list[int] | None], data: Callable[[], bytes]) -> Callable[[Any], None]:
    def mutate(case: Any) -> None:
        replace_item(case.root, BAD, item[0], item[1], data())

    return mutate


def _compressed(item: tuple[str, list[int] | None], data: Callable[[], bytes]) -> Any:
    """The target saved again with zstd, then one item replaced."""

    def mutate(case: Any) -> None:
        shutil.rmtree(case.root / BAD)
        writer = SafeStorageWriter(
            case.root, step=2, options=WriterOptions(fsync=False, compression="zstd")
        )
        dcp_safe.save(make_state(2), checkpoint_id=BAD, storage_writer=writer, no_dist=True)
        replace_item(case.root, BAD, item[0], item[1], data())

    return mutate


def manifest_dense_under_cap(case: Any) -> None:
    """``manifest.json`` is ``[[],[],...]`` one MiB under its cap: parsed, 7 GiB of lists."""
    count = (MANIFEST_MAX_BYTES - (1 << 20)) // 3
    data = b"[" + b"[]," * (count - 1) + b"[]]"
    path = Path(case.root) / BAD / layout.MANIFEST
    path.write_bytes(data)
    (Path(case.root) / BAD / layout.COMMITTED_MARKER).write_bytes(manifest_digest(data).encode())


def loads_the_target(mutate: Callable[[Any], None]) -> Callable[[Any], None]:
    """A case that touches only ``.metadata``: loads never read it, so ``latest`` is the
    target, exactly (verification still reads it, and refuses what is wrong with it)."""

    def wrapped(case: Any) -> None:
        mutate(case)
        case.latest = (BAD, 2)

    wrapped.__doc__ = mutate.__doc__
    return wrapped


def _doc(function: Callable[[Any], None], doc: str) -> Callable[[Any], None]:
    function.__doc__ = doc
    return function


DECODING_MUTATIONS: dict[str, Callable[[Any], None]] = {
    "metadata_build_onto_class": metadata_build_onto_class,
    "metadata_relative_path_outside": metadata_relative_path_outside,
    "metadata_memo_shared": metadata_memo_shared,
    "metadata_pickle_written_before": _written_before(
        _planted, "A live payload as .metadata, in a checkpoint without the plain form."
    ),
    "metadata_build_onto_class_written_before": _written_before(
        lambda case: poisoned_metadata(pickled_metadata(case.root, BAD)),
        "A BUILD onto MetadataIndex as .metadata, in a checkpoint without the plain form.",
    ),
    "metadata_wrong_types_written_before": _written_before(
        lambda case: wrong_types_metadata(pickled_metadata(case.root, BAD)),
        "DCP's types with wrongly typed fields, in a checkpoint without the plain form.",
    ),
    "metadata_memo_shared_written_before": _written_before(
        lambda case: memo_shared_metadata(pickled_metadata(case.root, BAD)),
        "Memo-shared lists as .metadata, in a checkpoint without the plain form.",
    ),
    "plain_metadata_wrong_types": plain_metadata_wrong_types,
    "plain_metadata_chunk_past_its_bytes": plain_metadata_chunk_past_its_bytes,
    "object_item_legacy_constructor": _doc(
        _item(_TAG, lambda: torch_archive(call_pickle(torch.FloatTensor, 1000))),
        "An object item that is torch.FloatTensor(1000): uninitialized memory.",
    ),
    "object_item_untyped_storage": _doc(
        _item(_TAG, lambda: torch_archive(call_pickle(torch.UntypedStorage, 1 << 20))),
        "An object item that is torch.UntypedStorage(2**20).",
    ),
    "object_item_allocation_bomb": _doc(
        _item(_TAG, lambda: torch_archive(call_pickle(bytearray, 1 << 30))),
        "An 800-byte object item that is bytearray(2**30).",
    ),
    "tensor_item_legacy_constructor": _doc(
        _item(
            _F32,
            lambda: torch_archive(call_pickle(torch.FloatTensor, 16, 8), {"pad": bytes(1024)}),
        ),
        "The f32 item is torch.FloatTensor(16, 8), padded to the bytes it declares.",
    ),
    "tensor_item_deflate_bomb": _doc(
        _item(
            _F32,
            lambda: torch_archive(
                tensor_pickle((16, 8), numel=1 << 28), zeros={"data/0": 1 << 30}, deflate={"data/0"}
            ),
        ),
        "The f32 item's storage record is DEFLATE: 1 MiB stored, 1 GiB inflated.",
    ),
    "tensor_item_zstd_bomb": _doc(
        _compressed(_F32, lambda: zstd_zeros(1 << 30)),
        "zstd checkpoint; the 16x8 f32 item is 32 KiB that inflate to 1 GiB.",
    ),
    "object_item_zstd_bomb": _doc(
        _compressed(_TAG, lambda: zstd_zeros(1 << 30)),
        "zstd checkpoint; an object item is 32 KiB that inflate to 1 GiB.",
    ),
    "manifest_dense_under_cap": manifest_dense_under_cap,
    "plain_metadata_tensor_declared_huge": plain_metadata_tensor_declared_huge,
    "object_item_nested_deep": _doc(
        _item(_TAG, lambda: torch_archive(_nested_list(5000))),
        "An object item that is a list nested 5,000 deep (a load re-serializes it).",
    ),
}

_UNSAFE = "refused: UnsafeCheckpointError"
_CORRUPT = "refused: CheckpointCorruptError"

#: Outcomes these cases must have (not merely a safe one): refused as a load refuses them,
#: by a load and by deep verification alike; the .metadata pickle never read where the plain
#: form is present.
DECODING_REQUIRED: dict[tuple[str, str], str] = {
    **{
        (case, entry): "ok: step_000000002"
        for case in ("metadata_build_onto_class", "metadata_relative_path_outside")
        for entry in ("dcp.load", "dcp_safe.load", "restore")
    },
    ("metadata_memo_shared", "verify_checkpoint"): "ok",
    **{
        (case, entry): _UNSAFE
        for case in (
            "metadata_pickle_written_before",
            "metadata_build_onto_class_written_before",
            "metadata_wrong_types_written_before",
            "metadata_memo_shared_written_before",
            "object_item_legacy_constructor",
            "object_item_untyped_storage",
            "object_item_allocation_bomb",
            "tensor_item_legacy_constructor",
            "tensor_item_deflate_bomb",
            "tensor_item_zstd_bomb",
            "object_item_zstd_bomb",
            "object_item_nested_deep",
        )
        for entry in ("dcp_safe.load", "verify_checkpoint")
    },
    **{
        (case, entry): _CORRUPT
        for case in (
            "plain_metadata_wrong_types",
            "plain_metadata_chunk_past_its_bytes",
            "plain_metadata_tensor_declared_huge",
        )
        for entry in ("dcp_safe.load", "verify_checkpoint")
    },
    ("plain_metadata_tensor_declared_huge", "cli inspect"): "exit 1: dcp-safe: error: CORRUPT",
    ("metadata_wrong_types_written_before", "cli inspect"): "exit 1: dcp-safe: error: ",
    ("plain_metadata_wrong_types", "cli inspect"): "exit 1: dcp-safe: error: CORRUPT",
    ("manifest_dense_under_cap", "list_checkpoints"): "ok: bad not listed",
    ("manifest_dense_under_cap", "dcp_safe.load"): "ok: step_000000001",
}
