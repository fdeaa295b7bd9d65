"""torch_checkpointing's own storage-facing behaviour, run on its local storage and on ours.

Issue #45 asks that every test of torch_checkpointing (meta-pytorch/torch_checkpointing,
``tests/``) that exercises storage and passes with its local storage pass with
``dcp_safe.torch_checkpointing``. The scenarios below are this project's own rewrites of what
those tests check through ``Storage`` (read there, not copied):

- ``test_checkpoint_manager.py``: a sync save returns None and writes ``<item>_<rank>.pt``;
  sync and async round trips;
- ``test_checkpointer.py``: module + optimizer (momentum state) + scalars round trip, with and
  without ``map_location``; partial loads (items, nested keys) and ``strict``; ``metadata.pkl``
  written and readable (a sync manager writes it with its first save, the async saver's
  subprocess into each); several saves from one manager;
- ``test_checkpoint_writer.py``: custom layouts (per-rank and global files, JSON, raw bytes),
  parallel file writes (``file_write_max_threads``);
- ``test_checkpoint_reader.py``: dtypes, empty tensors, lists of tensors in nested state,
  missing checkpoint (FileNotFoundError), a requested item without a file ("Missing file"),
  missing keys reported by a metadata-aware load, the no-resharder fast path (tc writes those
  files with ``torch.save``; here a manager writes them, as ours reads only what it published);
- ``test_checkpoint_reader_mmap.py``: loads with the mmap-backed path on and off;
- ``test_torch_serialization.py``: ``load_torch_serialized_from_storage`` with the parallel
  fill asked for by the environment;
- ``test_local_filesystem.py``: ``write``/``stream_write`` of bytes, bytearray, numpy, tensor
  and ``array`` buffers, read back whole and by range; ``exists``/``isdir``/``getsize``/``ls``/
  ``glob`` over a checkpoint.

Not covered, because they do not go through a ``Storage``: ``test_checkpoint_saver.py`` (mocked
stager and process: the staging lock), ``test_integrity.py`` (a newer ``integrity`` module, not
in 0.1.1, hashing local files directly), the loader's construction tests, and the reader tests
that pin private fast paths with hand-written ``DistributedMetadata``; ``test_default_resharder``'s
resharded loads need several ranks (``tests/test_torch_checkpointing.py`` runs 2 and 4 gloo
ranks on ours).

Every scenario in ``test_parity_*`` runs on both storages with the same assertions. Where ours
differs on purpose, ``test_difference_*`` asserts each storage's own behaviour. The differences,
and why:

1. Checkpoint ids are names under the root, not paths: a path outside the root (absolute, or
   through ``..``) is refused (ConfigError). A dcp_safe root is one catalogue
   (listing, ``"latest"``, retention) that every tool reads the same way.
2. No temporary directory and no rename: ``rename`` raises OSError; ``manager_config`` sets
   ``write_to_temp_dir=False`` and publishes with the manifest and the commit marker written
   last, because a rename is neither atomic nor cheap on object stores.
3. Nothing uncommitted exists: a file written but not yet published is invisible to
   ``exists``/``getsize``/``stream_read`` (FileNotFoundError), where the local storage shows
   whatever is on disk. A reader must never see half a checkpoint.
4. Neither overwrites a checkpoint: a second save of its id raises FileExistsError on both and
   the first still loads. Ours (CheckpointExistsError) refuses before any byte is written; the
   local storage, with its default temp-dir commit, after writing everything, and its
   ``tmp_<name>`` folder stays behind.
5. Every byte handed to torch_checkpointing is checked against the manifest: a flipped byte in
   tensor data loads silently altered values on the local storage and raises
   CheckpointCorruptError on ours, before anything is parsed.
6. Only a whole checkpoint is removed: ``delete`` of a file and ``rmdir`` of a folder inside
   a checkpoint raise OSError; ``rmdir`` of the checkpoint unpublishes it first. A removal cut
   short must never leave a listed checkpoint with files missing.
7. ``ls`` of a checkpoint also shows dcp_safe's own files (``manifest.json``, ``_COMMITTED``,
   ``_ranks/``); the data files listed are the same.
8. ``ls``/``glob`` on the root itself show committed checkpoints only (as
   ``dcp_safe.list_checkpoints`` does), where the local storage shows every entry.
9. A write before its checkpoint's ``mkdir`` fails on both and creates nothing, but with
   StorageError (an OSError) on ours where the local storage raises RuntimeError; ours also
   gives that save up, so further writes raise CommitError until a ``mkdir`` begins a new one
   (torch_checkpointing's writer always makes the folder first).
10. Whole-file loads read each file in one stream (``mmap_fill_workers`` is 1): every parallel
    fill range would read and check the whole file again. The loaded values are the same.
11. A layout file more than one folder deep (``a/b/deep.pt``) is refused on ours: a dcp_safe
    manifest names files at most one folder deep, so nothing it lists leads a reader outside
    the checkpoint: ``ConfigError`` before a byte of that file is written, and the save is given
    up, so the same manager can save the name again.
"""

from __future__ import annotations

import array
import contextlib
import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing")

import numpy as np
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    TorchSerialization,
)
from torch_checkpointing.checkpoint_writer import CallbackArgs, CheckpointWriterConfig
from torch_checkpointing.config import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.logging_utils import EventLogger
from torch_checkpointing.staging import CheckpointStagerConfig
from torch_checkpointing.storage.base_storage import ReadArgs, Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.torch_serialization import load_torch_serialized_from_storage

import dcp_safe
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CommitError,
    ConfigError,
    StorageError,
)
from dcp_safe.torch_checkpointing import SafeStorageConfig, manager_config

LOCAL, OURS = "tc local", "dcp_safe"
STORES = [LOCAL, OURS]
NAME = "step_000100"


@dataclass
class Store:
    """One storage under test, driven through torch_checkpointing's public API.

    ``ckpt(name)`` is the checkpoint id a manager takes (a path for the local storage, a name
    for ours); ``path(name, member)`` the path its ``Storage`` takes (absolute paths under a
    local root work for both).
    """

    kind: str
    root: Path

    @property
    def ours(self) -> bool:
        return self.kind == OURS

    def ckpt(self, name: str = NAME) -> str:
        return name if self.ours else str(self.root / name)

    def path(self, name: str = NAME, member: str = "") -> Path:
        return self.root / name / member if member else self.root / name

    def config(self, *, save: str = "sync", **options: Any) -> CheckpointManager.Config:
        writer = options.pop("writer", None)
        if self.ours:
            config = manager_config(self.root, save=save, **options)  # type: ignore[arg-type]
            if writer is not None:  # keep ours: no temp dir, whatever else the test sets
                writer.write_to_temp_dir = False
                config.save.writer_config = writer
            return config
        saver: Any
        if save == "sync":
            saver = SyncCheckpointSaverConfig()
        else:
            saver = AsyncCheckpointSaverConfig(staging_config=_plain_staging())
        if writer is not None:
            saver.writer_config = writer
        return CheckpointManager.Config(
            save=saver,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
            **options,
        )

    def manager(self, **options: Any) -> CheckpointManager:
        return CheckpointManager(self.config(**options))

    def storage(self) -> Storage:
        if self.ours:
            return SafeStorageConfig(self.root).create_storage()
        return LocalFileSystemStorageConfig(use_direct_io=False).create_storage()

    def publish(self, storage: Storage, name: str = NAME) -> None:
        """Make raw ``Storage`` writes readable: ours publishes them as manager_config's
        callbacks do after a manager's writes; the local storage has nothing to do."""
        if not self.ours:
            return
        config = manager_config(self.root, save="sync")
        args = CallbackArgs(path=name, storage=storage, event_logger=EventLogger())
        assert config.pre_finalize_callback is not None and config.finalize_callback is not None
        config.pre_finalize_callback(args)
        config.finalize_callback(args)


def _plain_staging() -> CheckpointStagerConfig:
    # CPU only: no pinned memory (it needs an accelerator), as tc's own CPU tests stage
    return CheckpointStagerConfig(
        use_async_staging=True,
        use_pinned_memory=False,
        use_shared_memory=True,
        use_non_blocking_copy=False,
    )


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    root = tmp_path / "root"
    root.mkdir()
    return Store(request.param, root)


# ------------------------------------------------------------------ payloads


class _Net(torch.nn.Module):
    """Nested modules with parameters, buffers (BatchNorm's running stats, an int64 counter)
    and an optional block, as tc's checkpointer tests use for nested partial loads."""

    def __init__(self, *, second_block: bool = True, bias: float = 0.0) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.full((8,), bias), requires_grad=False)
        self.block1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        self.block2 = (
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
            if second_block
            else None
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block1(x + self.bias)
        if self.block2 is not None:
            x = self.block2(x)
        out: torch.Tensor = self.head(x)
        return out


def _trained(seed: int = 0, *, second_block: bool = True) -> tuple[_Net, torch.optim.SGD]:
    """A model and an SGD optimizer one step in: momentum buffers and running stats set."""
    torch.manual_seed(seed)
    net = _Net(second_block=second_block, bias=float(seed))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return net, optimizer


def _payload(seed: int = 0, *, second_block: bool = True) -> dict[str, Any]:
    net, optimizer = _trained(seed, second_block=second_block)
    return {
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 5 + seed,
        "step": 1000 + seed,
    }


def _same(got: Any, want: Any) -> bool:
    """Deep equality: tensors bit-exact with the same dtype and shape."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got, want)
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want)


@contextlib.contextmanager
def _managed(store: Store, **options: Any) -> Iterator[CheckpointManager]:
    mgr = store.manager(**options)
    try:
        yield mgr
    finally:
        mgr.close()


def _save(store: Store, payload: dict[str, Any], name: str = NAME, **options: Any) -> None:
    with _managed(store, **options) as mgr:
        assert mgr.save(store.ckpt(name), payload) is None


def _load(store: Store, into: dict[str, Any], name: str = NAME, **options: Any) -> dict[str, Any]:
    load_options = {k: options.pop(k) for k in ("map_location", "strict") if k in options}
    with _managed(store, **options) as mgr:
        return dict(mgr.load(store.ckpt(name), into=into, **load_options))


_RESHARDED = {"model": ItemSpec(resharder=DefaultResharder())}


# ------------------------------------------------------------------ parity: manager round trips


def test_parity_sync_save_returns_none_and_writes_rank_files(store: Store) -> None:
    """test_checkpoint_manager: sync save -> None, ``model_0.pt``/``step_0.pt``, round trip."""
    saved = {"model": torch.arange(4), "step": 10}
    _save(store, saved)
    storage = store.storage()
    for member in ("model_0.pt", "step_0.pt"):
        assert storage.exists(store.path(NAME, member))
        assert not storage.isdir(store.path(NAME, member))
    assert storage.isdir(store.path(NAME))
    loaded = _load(store, {"model": torch.zeros(4, dtype=torch.long), "step": 0})
    assert _same(loaded, saved)


@pytest.mark.parametrize("map_location", [None, "cpu"])
@pytest.mark.parametrize("items", [{}, _RESHARDED], ids=["fast_path", "resharder"])
def test_parity_module_optimizer_and_scalars_round_trip(
    store: Store, map_location: str | None, items: dict[str, ItemSpec]
) -> None:
    """test_checkpointer.test_save_and_load_basic: nested module state (buffers included), SGD
    momentum state and scalars come back bit-exact, into a differently initialised target."""
    saved = _payload(0)
    _save(store, saved, items=items)
    target, _ = _trained(7)
    into = {"model": target.state_dict(), "optimizer": None, "epoch": None, "step": None}
    loaded = _load(store, into, items=items, map_location=map_location)
    assert _same(loaded, saved)
    # the live target was filled in place
    assert _same(target.state_dict(), saved["model"])


def test_parity_partial_load_of_items(store: Store) -> None:
    """test_checkpointer.test_partial_load: only the items asked for are read."""
    saved = _payload(1)
    _save(store, saved)
    loaded = _load(store, {"model": _Net().state_dict(), "epoch": None})
    assert sorted(loaded) == ["epoch", "model"]
    assert _same(loaded["model"], saved["model"])
    assert loaded["epoch"] == saved["epoch"]


@pytest.mark.parametrize("items", [{}, _RESHARDED], ids=["fast_path", "resharder"])
def test_parity_nested_partial_load(store: Store, items: dict[str, ItemSpec]) -> None:
    """test_checkpointer.test_nested_dict_partial_load: a target without ``block2`` takes the
    rest of a full checkpoint."""
    saved = _payload(2)
    _save(store, saved, items=items)
    partial = _Net(second_block=False).state_dict()
    loaded = _load(store, {"model": partial, "step": None}, items=items)
    assert sorted(loaded["model"]) == sorted(partial)
    assert not any(key.startswith("block2.") for key in loaded["model"])
    for key in partial:
        assert _same(loaded["model"][key], saved["model"][key])
    assert loaded["step"] == saved["step"]


@pytest.mark.parametrize("strict", [False, True])
def test_parity_full_target_from_partial_checkpoint(store: Store, strict: bool) -> None:
    """test_checkpointer.test_load_full_model_from_partial_checkpoint: the keys a checkpoint
    lacks are reported (a RuntimeError naming them with ``strict``), the rest load."""
    saved = _payload(3, second_block=False)
    _save(store, saved, items=_RESHARDED)
    target = _Net(second_block=True, bias=9.0)
    into = {"model": target.state_dict(), "step": None}
    if strict:
        with pytest.raises(RuntimeError, match=r"missing keys.*block2"):
            _load(store, into, items=_RESHARDED, strict=True)
        return
    loaded = _load(store, into, items=_RESHARDED)
    assert _same(loaded["model"]["bias"], saved["model"]["bias"])
    assert _same(loaded["model"]["block1.0.weight"], saved["model"]["block1.0.weight"])
    assert loaded["step"] == saved["step"]


def test_parity_metadata_pkl_written_and_readable(store: Store) -> None:
    """test_checkpointer.test_metadata_file_written: with a resharder declared, a save carries
    ``metadata.pkl`` (a pickled dict). A sync manager writes it with its first save only (the
    layout is unchanged after), on both storages, and a metadata-aware load of each works."""
    storage = store.storage()
    names = ("step_000001", "step_000002")
    with _managed(store, items=_RESHARDED) as mgr:
        for number, name in enumerate(names):
            mgr.save(store.ckpt(name), _payload(number))
    assert [storage.exists(store.path(name, "metadata.pkl")) for name in names] == [True, False]
    # the test's own freshly written file: unpickling it is what tc's test does too
    metadata = pickle.loads(storage.read(store.path(names[0], "metadata.pkl")))
    assert isinstance(metadata, dict)
    assert metadata["world_size"] == 1
    assert set(metadata["metadata"]) == {"model"}
    for number, name in enumerate(names):
        into = {"model": _Net().state_dict(), "step": None}
        loaded = _load(store, into, name, items=_RESHARDED)
        assert _same(loaded["model"], _payload(number)["model"])


def test_parity_sequential_saves_of_changing_state(store: Store) -> None:
    """test_checkpointer.test_async_sequential_saves (sync here): one manager, state changed
    between saves, each checkpoint holds its own state."""
    net, _ = _trained(0)
    with _managed(store) as mgr:
        for step in range(3):
            mgr.save(store.ckpt(f"step_{step:06d}"), {"model": net.state_dict(), "step": step})
            with torch.no_grad():
                net.bias.add_(1)
    for step in range(3):
        loaded = _load(store, {"model": None, "step": None}, f"step_{step:06d}")
        assert loaded["step"] == step
        assert torch.equal(loaded["model"]["bias"], torch.full((8,), float(step)))


def _layout_items() -> dict[str, ItemSpec]:
    return {
        "model": ItemSpec(layout=LayoutInfo("model_rank_{rank}.pt", TorchSerialization())),
        "optimizer": ItemSpec(layout=LayoutInfo("shards/opt_{rank}.pt", TorchSerialization())),
        "epoch": ItemSpec(layout=LayoutInfo("epoch_rank_{rank}.json", JsonSerialization(str))),
        "config": ItemSpec(layout=LayoutInfo("config.json", JsonSerialization())),
        "blob": ItemSpec(layout=LayoutInfo("blob.bin", RawSerialization()), requires_copy=False),
        "weights": ItemSpec(layout=LayoutInfo("weights.safetensors", SafetensorsSerialization())),
    }


@pytest.mark.parametrize("threads", [1, 3])
def test_parity_custom_layouts_round_trip(store: Store, threads: int) -> None:
    """test_checkpoint_writer (simple, global-file and raw layouts; file_write_max_threads)
    and test_checkpoint_reader.test_read_with_simple_layout: each item lands at its layout's
    path in its format, files written in parallel, and reads back."""
    saved = _payload(4)
    payload = {
        "model": saved["model"],
        "optimizer": saved["optimizer"],
        "epoch": "5",
        "config": {"lr": 0.01, "layers": [8, 16, 4], "name": "net"},
        "blob": b"\x00raw bytes\xff" * 100,
        "weights": {"w": torch.randn(3, 5), "ids": torch.arange(7, dtype=torch.int32)},
    }
    writer = CheckpointWriterConfig(file_write_max_threads=threads)
    _save(store, payload, items=_layout_items(), writer=writer)

    storage = store.storage()
    members = (
        "model_rank_0.pt",
        "shards/opt_0.pt",
        "epoch_rank_0.json",
        "config.json",
        "blob.bin",
        "weights.safetensors",
    )
    for member in members:
        assert storage.exists(store.path(NAME, member)), member
    assert storage.isdir(store.path(NAME, "shards"))
    assert json.loads(storage.read(store.path(NAME, "epoch_rank_0.json"))) == "5"
    assert json.loads(storage.read(store.path(NAME, "config.json"))) == payload["config"]
    assert storage.read(store.path(NAME, "blob.bin")) == payload["blob"]

    into = {key: None for key in payload}
    loaded = _load(store, into, items=_layout_items())
    assert _same(loaded, payload)


def test_parity_dtypes_empty_tensors_and_python_values(store: Store) -> None:
    """test_checkpoint_reader.test_read_different_dtypes / test_read_empty_tensor and the
    nested lists of its state dict: every dtype, empty shapes, lists, strings, None."""
    gen = torch.Generator().manual_seed(5)
    saved = {
        "tensors": {
            "f16": torch.randn(4, 4, generator=gen).half(),
            "bf16": torch.randn(4, 4, generator=gen).bfloat16(),
            "f32": torch.randn(10, 10, generator=gen),
            "f64": torch.randn(10, 10, generator=gen, dtype=torch.float64),
            "i8": torch.randint(-100, 100, (9,), generator=gen, dtype=torch.int8),
            "i32": torch.randint(-100, 100, (10, 10), generator=gen, dtype=torch.int32),
            "i64": torch.randint(-100, 100, (10, 10), generator=gen),
            "bool": torch.randint(0, 2, (10, 10), generator=gen).bool(),
            "c64": torch.randn(3, generator=gen, dtype=torch.complex64),
            "scalar": torch.tensor(3.5),
        },
        "empty": {"0": torch.empty(0), "0x5": torch.empty(0, 5), "2x0x3": torch.empty(2, 0, 3)},
        "nested": {
            "list": [torch.randn(2, generator=gen), torch.randn(2, generator=gen)],
            "groups": [{"lr": 0.01, "params": [0, 1], "name": "g0", "extra": None}],
        },
        "text": "hello",
        "none": None,
    }
    _save(store, saved)
    loaded = _load(store, {key: None for key in saved})
    assert _same(loaded, saved)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_parity_load_with_and_without_mmap(store: Store, use_mmap: bool) -> None:
    """test_checkpoint_reader_mmap: the mmap-backed load and the plain stream load."""
    saved = {"model": {"weights": torch.arange(4, dtype=torch.float32)}, "step": 3}
    _save(store, saved)
    loaded = _load(
        store, {"model": None, "step": None}, load=CheckpointLoaderConfig(use_mmap=use_mmap)
    )
    assert _same(loaded, saved)


@pytest.mark.parametrize("items", [{}, _RESHARDED], ids=["fast_path", "resharder"])
def test_parity_missing_checkpoint_is_file_not_found(store: Store, items: dict[str, Any]) -> None:
    """test_checkpoint_reader.test_read_nonexistent_checkpoint (both read paths)."""
    _save(store, _payload(0), name="step_000001")
    with pytest.raises(FileNotFoundError):
        _load(store, {"model": _Net().state_dict()}, "step_000999", items=items)


def test_parity_item_without_a_file(store: Store) -> None:
    """test_checkpoint_reader.test_missing_keys_reported: an item the checkpoint has no file
    for fails the fast path with "Missing file" naming it."""
    _save(store, {"model": _payload(0)["model"]})
    with pytest.raises(FileNotFoundError, match=r"Missing file .*optimizer_0\.pt"):
        _load(store, {"model": None, "optimizer": None})


def test_parity_closed_manager_refuses_load(store: Store) -> None:
    """test_checkpoint_manager.test_load_on_closed_manager_raises."""
    mgr = store.manager()
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.load(store.ckpt(), {"model": None})


# ------------------------------------------------------------------ parity: the Storage API


def _buffers() -> list[Any]:
    """The buffer kinds tc's local-filesystem test writes."""
    return [
        b"Hello bytes! ",
        bytearray(b"Hello bytearray! "),
        np.array([1, 2, 3, 4, 5], dtype=np.int32),
        torch.tensor([10, 20, 30, 40, 50], dtype=torch.int32).numpy(),
        array.array("i", [100, 200, 300, 400, 500]),
    ]


def _expected() -> bytes:
    return b"".join(memoryview(buffer).cast("B").tobytes() for buffer in _buffers())


def test_parity_storage_writes_every_buffer_kind_and_reads_it_back(store: Store) -> None:
    """test_local_filesystem: ``write`` of the joined bytes and ``stream_write`` of each buffer
    kind give the same file; read back whole, by range, with its size, listed and globbed."""
    storage = store.storage()
    storage.mkdir(store.path(NAME))
    storage.mkdir(store.path(NAME, "level2"))
    storage.write(store.path(NAME, "write_output.bin"), _expected())
    with storage.stream_write(store.path(NAME, "level2/stream_output.bin")) as stream:
        for buffer in _buffers():
            stream.write(buffer)
    store.publish(storage)

    expected = _expected()
    for member in ("write_output.bin", "level2/stream_output.bin"):
        path = store.path(NAME, member)
        assert storage.exists(path)
        assert storage.getsize(path) == len(expected)
        assert storage.read(path) == expected
        with storage.stream_read(path) as stream:
            assert stream.read() == expected
        with storage.stream_read(path, ReadArgs(pre_read_full_file=False)) as stream:
            assert stream.seek(13) == 13
            assert stream.read(17) == expected[13:30]
            assert stream.tell() == 30
    assert storage.isdir(store.path(NAME, "level2"))
    assert not storage.exists(store.path(NAME, "absent.bin"))
    assert {"level2", "write_output.bin"} <= set(storage.ls(store.path(NAME)))
    assert storage.ls(store.path(NAME, "level2")) == ["stream_output.bin"]
    assert storage.glob(str(store.path(NAME, "*.bin"))) == [
        str(store.path(NAME, "write_output.bin"))
    ]


def test_parity_parallel_fill_load_from_storage(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_torch_serialization: a file larger than one fill chunk, loaded with the parallel
    fill the environment asks for, is byte-identical."""
    saved = {"model": {"w": torch.arange(400_000, dtype=torch.float32)}, "step": 7}
    _save(store, saved)
    monkeypatch.setenv("TORCH_CKPT_PARALLEL_FILL_WORKERS", "4")
    monkeypatch.setenv("TORCH_CKPT_PARALLEL_FILL_CHUNK_MB", "1")
    loaded = load_torch_serialized_from_storage(
        store.path(NAME, "model_0.pt"), store.storage(), map_location="cpu"
    )
    assert _same(loaded, saved["model"])


@pytest.mark.subprocess
def test_parity_async_saves_round_trip(store: Store) -> None:
    """test_checkpoint_manager.test_async_save_then_load_round_trip, test_checkpointer's
    sequential async saves and test_metadata_sent_once_to_subprocess: the saver's subprocess
    writes (and, for ours, publishes) each save, ``metadata.pkl`` included."""
    config = store.config(save="async", items=_RESHARDED)
    assert isinstance(config.save, AsyncCheckpointSaverConfig)
    config.save.staging_config = _plain_staging()
    mgr = CheckpointManager(config)
    try:
        futures = []
        for step in range(2):
            future = mgr.save(store.ckpt(f"step_{step:06d}"), _payload(step))
            assert future is not None
            futures.append(future)
        for future in futures:
            future.result(timeout=120)
        storage = store.storage()
        for step in range(2):
            name = f"step_{step:06d}"
            # the saver's subprocess writes the metadata it was sent once into every save
            assert storage.exists(store.path(name, "metadata.pkl"))
            into = {"model": _Net().state_dict(), "optimizer": None, "step": None}
            loaded = dict(mgr.load(store.ckpt(name), into=into))
            want = _payload(step)
            assert _same(loaded["model"], want["model"])
            assert _same(loaded["optimizer"], want["optimizer"])
            assert loaded["step"] == want["step"]
    finally:
        mgr.close()


def test_parity_write_needs_its_folder_first(store: Store) -> None:
    """test_local_filesystem.test_write_fails_if_parent_dir_not_created: a write before the
    checkpoint's folder is made fails and creates nothing; after ``mkdir`` it works. (Which
    error each raises: test_difference_write_before_mkdir.)"""
    storage = store.storage()
    path = store.path(NAME, "test_file.bin")
    with pytest.raises(Exception):  # noqa: B017 - each storage's own error, pinned below
        storage.write(path, b"test data")
    with pytest.raises(Exception), storage.stream_write(path) as stream:  # noqa: B017
        stream.write(b"test data")
    assert list(store.root.rglob("*")) == []
    storage.mkdir(store.path(NAME))
    storage.write(path, b"test data")
    store.publish(storage)
    assert storage.read(path) == b"test data"


# ------------------------------------------------------------------ differences, on purpose


def test_difference_ids_are_names_under_the_root(store: Store, tmp_path: Path) -> None:
    """1. A checkpoint id is a name under the root: ours refuses a path elsewhere."""
    elsewhere = tmp_path / "elsewhere" / "ckpt"
    for bad in (str(elsewhere), "../outside"):
        if store.ours:
            with pytest.raises(ConfigError, match="not a checkpoint path under the root"):
                _save(store, {"step": 1}, name=bad)
        else:
            _save(store, {"step": 1}, name=bad)
    if store.ours:
        assert not elsewhere.exists() and not (store.root.parent / "outside").exists()
    else:
        assert (elsewhere / "step_0.pt").is_file()


def test_difference_no_rename(store: Store) -> None:
    """2. Ours never renames (publication is the manifest and the commit marker)."""
    storage = store.storage()
    storage.mkdir(store.path(NAME))
    storage.write(store.path(NAME, "a.bin"), b"a")
    if store.ours:
        with pytest.raises(OSError, match=r"rename of .* refused"):
            storage.rename(store.path(NAME, "a.bin"), store.path(NAME, "b.bin"))
    else:
        storage.rename(store.path(NAME, "a.bin"), store.path(NAME, "b.bin"))
        assert storage.read(store.path(NAME, "b.bin")) == b"a"


def test_difference_unpublished_files_do_not_exist(store: Store) -> None:
    """3. A file written but not yet published is invisible on ours."""
    storage = store.storage()
    storage.mkdir(store.path(NAME))
    storage.write(store.path(NAME, "a.bin"), b"abc")
    path = store.path(NAME, "a.bin")
    if store.ours:
        assert not storage.exists(store.path(NAME)) and not storage.exists(path)
        with pytest.raises(FileNotFoundError):
            storage.getsize(path)
        with pytest.raises(FileNotFoundError):
            storage.read(path)
        assert dcp_safe.list_checkpoints(store.root) == []
        store.publish(storage)
    assert storage.exists(path) and storage.read(path) == b"abc"


def test_difference_second_save_of_a_name(store: Store) -> None:
    """4. Both refuse to save a name twice (a FileExistsError) and keep the first; ours
    refuses before writing anything, the local storage after writing it all under ``tmp_``."""
    saved = {"model": torch.arange(5), "step": 1}
    _save(store, saved)
    with pytest.raises(FileExistsError) as info:
        _save(store, {"model": torch.arange(5) + 1, "step": 2})
    assert _same(_load(store, {"model": None, "step": None}), saved)
    leftovers = sorted(entry.name for entry in store.root.iterdir())
    if store.ours:
        assert isinstance(info.value, CheckpointExistsError)
        assert leftovers == [NAME]
    else:
        assert leftovers == [NAME, f"tmp_{NAME}"]


@pytest.mark.parametrize("use_mmap", [True, False])
def test_difference_a_flipped_data_byte(store: Store, use_mmap: bool) -> None:
    """5. A flipped byte inside tensor data: the local storage loads the altered value, ours
    refuses the file before torch_checkpointing parses it."""
    weights = torch.arange(1000, dtype=torch.float32)
    _save(store, {"model": {"w": weights}})
    path = store.root / NAME / "model_0.pt"
    data = bytearray(path.read_bytes())
    data[bytes(data).index(torch.tensor([500.0]).numpy().tobytes()) + 3] ^= 0x01
    path.write_bytes(bytes(data))
    load = CheckpointLoaderConfig(use_mmap=use_mmap)
    if store.ours:
        with pytest.raises(CheckpointCorruptError, match=r"model_0\.pt.*checksum mismatch"):
            _load(store, {"model": None}, load=load)
    else:
        loaded = _load(store, {"model": None}, load=load)["model"]["w"]
        assert loaded[500].item() != 500.0
        assert torch.equal(loaded[:500], weights[:500])


def test_difference_delete_and_rmdir(store: Store) -> None:
    """6. Ours removes only whole checkpoints (unpublished first): a file or a folder inside
    one is refused; the local storage deletes whatever it is given."""
    _save(store, {"model": torch.arange(3), "step": 1})
    storage = store.storage()
    member = store.path(NAME, "step_0.pt")
    if store.ours:
        with pytest.raises(OSError, match=r"delete of .* refused"):
            storage.delete(member)
        with pytest.raises(OSError, match=r"rmdir of .* refused"):
            storage.rmdir(store.path(NAME, "_ranks"))
        assert storage.exists(member)
    else:
        storage.delete(member)
        assert not storage.exists(member)
    storage.rmdir(store.path(NAME))
    assert not storage.exists(store.path(NAME))
    assert dcp_safe.list_checkpoints(store.root) == []


def test_difference_listing(store: Store) -> None:
    """7 and 8. ``ls`` of a checkpoint shows dcp_safe's own files too; ``ls`` of the root shows
    committed checkpoints only (what dcp_safe.list_checkpoints shows)."""
    _save(store, {"model": torch.arange(3), "step": 1})
    (store.root / "step_000200").mkdir()  # a folder that is no committed checkpoint
    storage = store.storage()
    data = {"model_0.pt", "step_0.pt"}
    if store.ours:
        assert set(storage.ls(store.path(NAME))) == data | {"manifest.json", "_COMMITTED", "_ranks"}
        assert storage.ls(store.root) == [NAME]
        assert storage.glob(str(store.root / "step_*")) == [str(store.path(NAME))]
        assert [info.name for info in dcp_safe.list_checkpoints(store.root)] == [NAME]
    else:
        assert set(storage.ls(store.path(NAME))) == data
        assert sorted(storage.ls(store.root)) == [NAME, "step_000200"]
        assert sorted(storage.glob(str(store.root / "step_*"))) == [
            str(store.path(NAME)),
            str(store.root / "step_000200"),
        ]


def test_difference_write_before_mkdir(store: Store) -> None:
    """9. Each storage's error for a write before its folder: the local storage's
    RuntimeError; ours a StorageError (an OSError), which gives the save up, so the next
    write is refused until a ``mkdir`` begins a new one."""
    storage = store.storage()
    path = store.path(NAME, "a.bin")
    if store.ours:
        with pytest.raises(StorageError):
            storage.write(path, b"a")
        with pytest.raises(CommitError, match="failed on this rank"):
            storage.write(path, b"a")
    else:
        with pytest.raises(RuntimeError, match="Parent directory does not exist"):
            storage.write(path, b"a")


def test_difference_whole_file_reads_are_one_stream(store: Store) -> None:
    """10. Ours asks for one fill worker: each range would read and check the whole file."""
    assert store.storage().mmap_fill_workers == (1 if store.ours else None)


def _deep_layout() -> dict[str, ItemSpec]:
    return {
        "deep": ItemSpec(layout=LayoutInfo("a/b/deep.pt", TorchSerialization()), required=False)
    }


def test_difference_files_two_folders_deep(store: Store) -> None:
    """11. A layout file two folders deep inside the checkpoint: the local storage writes it;
    a dcp_safe manifest names files at most one folder deep, so ours refuses the save."""
    payload = {"model": torch.arange(3), "deep": torch.zeros(2)}
    if store.ours:
        with pytest.raises(ConfigError, match="not a file a checkpoint can hold"):
            _save(store, payload, items=_deep_layout())
        assert dcp_safe.list_checkpoints(store.root) == []
    else:
        _save(store, payload, items=_deep_layout())
        loaded = _load(store, {"model": None, "deep": None}, items=_deep_layout())
        assert _same(loaded, payload)


def test_ours_refuses_a_deep_file_as_a_config_error_before_writing(tmp_path: Path) -> None:
    store = Store(OURS, tmp_path)
    with pytest.raises(ConfigError, match=r"a/b/deep\.pt"):
        _save(store, {"model": torch.arange(3), "deep": torch.zeros(2)}, items=_deep_layout())
    assert not any(path.name == "deep.pt" for path in tmp_path.rglob("*"))


def test_ours_saves_a_name_again_after_a_refused_deep_file(tmp_path: Path) -> None:
    store = Store(OURS, tmp_path)
    with _managed(store, items=_deep_layout()) as mgr:
        with pytest.raises(ConfigError):
            mgr.save(NAME, {"model": torch.arange(3), "deep": torch.zeros(2)})
        mgr.save(NAME, {"model": torch.arange(3) + 1})
    assert _same(_load(store, {"model": None}), {"model": torch.arange(3) + 1})
