"""dcp_safe.torch_checkpointing: torch_checkpointing's saves through dcp_safe's storage, commit
and catalogue (issue #45), on real components: CheckpointManager, the local backend."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing")

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.storage.base_storage import ReadArgs

import dcp_safe
import dcp_safe.torch_checkpointing as tc_module
from dcp_safe.backends.roots import open_backend
from dcp_safe.cli import main as cli_main
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import (
    CheckpointCorruptError,
    ConfigError,
    SignatureError,
    UnsignedCheckpointError,
)
from dcp_safe.replication.replicator import replicate_checkpoint
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
from dcp_safe.testing.multiproc import run_ranks
from dcp_safe.topology import Root
from dcp_safe.torch_checkpointing import DATA_FORMAT, SafeStorageConfig, manager_config

NAME = "step_000100"


def _payload(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=gen),
            "b": torch.randint(0, 1000, (17,), generator=gen),
        },
        "step": 100 + seed,
    }


def _template() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(17, dtype=torch.int64)},
        "step": None,
    }


def _manager(root: Path | str, **options: Any) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=DefaultResharder())}
    return CheckpointManager(manager_config(root, save="sync", items=items, **options))


def _load(root: Path, name: str = NAME, **options: Any) -> dict[str, Any]:
    mgr = _manager(root, **options)
    try:
        return dict(mgr.load(name, into=_template()))
    finally:
        mgr.close()


def _save(root: Path | str, name: str = NAME, seed: int = 0, **options: Any) -> dict[str, Any]:
    payload = _payload(seed)
    mgr = _manager(root, **options)
    try:
        mgr.save(name, payload)
    finally:
        mgr.close()
    return payload


def _assert_same(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert loaded["step"] == saved["step"]
    for key, tensor in saved["model"].items():
        got = loaded["model"][key]
        assert got.dtype == tensor.dtype
        assert torch.equal(got, tensor)


def test_save_load_bit_exact_listed_and_verified(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    _assert_same(_load(tmp_path), saved)

    listed = dcp_safe.list_checkpoints(tmp_path)
    assert [info.name for info in listed] == [NAME]
    assert listed[0].step == 100
    deep = dcp_safe.verify_checkpoint(tmp_path, NAME, deep=True)
    files = {p.relative_to(tmp_path / NAME).as_posix() for p in (tmp_path / NAME).rglob("*")}
    assert {"metadata.pkl", "model_0.pt", "step_0.pt", "_ranks/rank_00000.json"} <= files
    # every file but the manifest and the marker, read in full against its checksum
    assert deep.files_checked == 4
    assert deep.bytes_read == sum(
        (tmp_path / NAME / f).stat().st_size
        for f in ("metadata.pkl", "model_0.pt", "step_0.pt", "_ranks/rank_00000.json")
    )
    assert dcp_safe.verify_checkpoint(tmp_path, NAME, deep=False).files_checked == 4
    manifest = (tmp_path / NAME / "manifest.json").read_text()
    assert f'"data_format":"{DATA_FORMAT}"' in manifest


def test_latest_is_the_newest_save(tmp_path: Path) -> None:
    _save(tmp_path, "step_000100", seed=0)
    newer = _save(tmp_path, "step_000200", seed=1)
    assert dcp_safe.verify_checkpoint(tmp_path).name == "step_000200"
    _assert_same(_load(tmp_path, "step_000200"), newer)


@pytest.mark.parametrize("member", ["model_0.pt", "metadata.pkl", "step_0.pt"])
def test_flipped_byte_refused_before_parsing(tmp_path: Path, member: str) -> None:
    _save(tmp_path)
    path = tmp_path / NAME / member
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch in bytes 0\.\.") as info:
        _load(tmp_path)
    assert info.value.path.endswith(f"{NAME}/{member}")
    with pytest.raises(CheckpointCorruptError):
        dcp_safe.verify_checkpoint(tmp_path, NAME, deep=True)


@pytest.mark.parametrize("member", ["model_0.pt", "metadata.pkl"])
def test_truncated_file_refused(tmp_path: Path, member: str) -> None:
    _save(tmp_path)
    path = tmp_path / NAME / member
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(CheckpointCorruptError, match="file size differs") as info:
        _load(tmp_path)
    assert info.value.expected == len(data)
    assert info.value.actual == len(data) - 7


def test_file_swapped_from_another_checkpoint_refused(tmp_path: Path) -> None:
    _save(tmp_path, "step_000100", seed=0)
    _save(tmp_path, "step_000200", seed=1)
    other = (tmp_path / "step_000200" / "model_0.pt").read_bytes()
    (tmp_path / "step_000100" / "model_0.pt").write_bytes(other)
    with pytest.raises(CheckpointCorruptError):
        _load(tmp_path, "step_000100")


def test_unfinalized_save_is_not_listed_nor_loaded(tmp_path: Path) -> None:
    """A save killed before its finalize (simulated: no finalize callback) leaves nothing that
    lists or loads; the job saves the same name again afterwards."""
    committed = _save(tmp_path, "step_000100", seed=0)
    config = manager_config(
        tmp_path, save="sync", items={"model": ItemSpec(resharder=DefaultResharder())}
    )
    config.finalize_callback = None
    mgr = CheckpointManager(config)
    mgr.save("step_000200", _payload(1))
    mgr.close()

    assert [info.name for info in dcp_safe.list_checkpoints(tmp_path)] == ["step_000100"]
    assert dcp_safe.verify_checkpoint(tmp_path).name == "step_000100"
    _assert_same(_load(tmp_path, "step_000100"), committed)
    with pytest.raises(FileNotFoundError):
        _load(tmp_path, "step_000200")

    again = _save(tmp_path, "step_000200", seed=2)
    _assert_same(_load(tmp_path, "step_000200"), again)
    assert dcp_safe.verify_checkpoint(tmp_path).name == "step_000200"


def test_committed_name_is_not_overwritten(tmp_path: Path) -> None:
    saved = _save(tmp_path, seed=0)
    with pytest.raises(dcp_safe.errors.CheckpointExistsError):
        _save(tmp_path, seed=1)
    _assert_same(_load(tmp_path), saved)


def test_signed_saves_load_only_with_their_key(tmp_path: Path) -> None:
    saved = _save(tmp_path, signing_key=b"k" * 32)
    _assert_same(_load(tmp_path, signing_key=b"k" * 32), saved)
    with pytest.raises(SignatureError):
        _load(tmp_path, signing_key=b"x" * 32)
    _save(tmp_path / "plain")
    with pytest.raises(UnsignedCheckpointError):
        _load(tmp_path / "plain", signing_key=b"k" * 32)


def test_manager_config_refuses_what_it_sets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sets"):
        manager_config(tmp_path, finalize_callback=None)
    with pytest.raises(ConfigError, match=r"not cryptographic.*blake3.*sha256"):
        manager_config(tmp_path, signing_key=b"k" * 32, checksum="xxh3_128")
    with pytest.raises(ConfigError, match="'async' or 'sync'"):
        manager_config(tmp_path, save="later")  # type: ignore[arg-type]
    storage = SafeStorageConfig(tmp_path).create_storage()
    with pytest.raises(OSError, match="rename"):
        storage.rename(Path("a"), Path("b"), is_directory=True)
    with pytest.raises(ConfigError):
        storage.exists(Path("../elsewhere"))


def _rank_save_and_load(rank: int, world_size: int, root: str) -> bool:
    saved = _payload(rank)
    mgr = CheckpointManager(manager_config(root, save="sync"))
    try:
        mgr.save(NAME, saved)
        loaded = dict(mgr.load(NAME, into=_template()))
    finally:
        mgr.close()
    _assert_same(loaded, saved)
    return True


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_save_one_checkpoint(tmp_path: Path, world_size: int) -> None:
    assert run_ranks(_rank_save_and_load, world_size, args=(str(tmp_path),)) == [True] * world_size
    (info,) = dcp_safe.list_checkpoints(tmp_path)
    assert (info.name, info.world_size) == (NAME, world_size)
    report = dcp_safe.verify_checkpoint(tmp_path, NAME, deep=True)
    # each rank's model and step files and its rank manifest
    assert report.files_checked == 3 * world_size
    files = {p.name for p in (tmp_path / NAME).rglob("*") if p.is_file()}
    for rank in range(world_size):
        assert {f"model_{rank}.pt", f"step_{rank}.pt", f"rank_{rank:05d}.json"} <= files


@pytest.mark.s3
def test_s3_save_lists_verifies_and_loads(s3_root: str, s3_options: dict[str, Any]) -> None:
    saved = _payload(0)
    mgr = CheckpointManager(manager_config(s3_root, save="sync", storage_options=s3_options))
    try:
        mgr.save(NAME, saved)
        _assert_same(dict(mgr.load(NAME, into=_template())), saved)
    finally:
        mgr.close()
    root = Root(s3_root, storage_options=s3_options)
    assert [info.name for info in dcp_safe.list_checkpoints(root)] == [NAME]
    assert dcp_safe.verify_checkpoint(root, NAME, deep=True).files_checked == 3

    backend = open_backend(root)
    data = bytearray(backend.read_bytes(f"{NAME}/model_0.pt"))
    data[-40] ^= 0x10
    backend.write_bytes(f"{NAME}/model_0.pt", bytes(data))
    mgr = CheckpointManager(manager_config(s3_root, save="sync", storage_options=s3_options))
    try:
        with pytest.raises(CheckpointCorruptError, match=r"model_0\.pt"):
            mgr.load(NAME, into=_template())
    finally:
        mgr.close()


@pytest.mark.subprocess
def test_async_saver_publishes_from_its_subprocess(tmp_path: Path) -> None:
    """torch_checkpointing's async saver writes and runs the callbacks in its own process:
    the storage config and callbacks travel there, and the save lists and loads the same."""
    saved = _payload(3)
    mgr = CheckpointManager(manager_config(tmp_path, save="async"))
    try:
        future = mgr.save(NAME, saved)
        assert future is not None
        future.result(timeout=120)
        assert [info.name for info in dcp_safe.list_checkpoints(tmp_path)] == [NAME]
        assert dcp_safe.verify_checkpoint(tmp_path, NAME, deep=True).files_checked == 3
        _assert_same(dict(mgr.load(NAME, into=_template())), saved)
    finally:
        mgr.close()


def test_dcp_tools_say_precisely_why_not(tmp_path: Path) -> None:
    """What needs DCP's metadata (export here; inspect and DCP loads read it the same way)
    names the format instead of calling the checkpoint unsafe."""
    _save(tmp_path)
    with pytest.raises(ConfigError, match="holds torch_checkpointing's files, not DCP's"):
        dcp_safe.export(tmp_path, NAME, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_ranged_reads_come_from_checked_bytes(tmp_path: Path) -> None:
    """The offset reads torch_checkpointing's resharder makes (no full pre-read, then seek)
    see the stored bytes exactly, and a damaged file fails at the first read, before any byte
    is handed over."""
    _save(tmp_path)
    storage = SafeStorageConfig(tmp_path).create_storage()
    member = Path(NAME) / "model_0.pt"
    stored = (tmp_path / member).read_bytes()
    assert storage.getsize(member) == len(stored)
    assert storage.exists(Path(NAME)) and storage.exists(member)
    assert not storage.exists(Path(NAME) / "manifest-less.pt")
    with storage.stream_read(member, ReadArgs(pre_read_full_file=False)) as stream:
        assert stream.seek(100) == 100
        assert stream.read(50) == stored[100:150]

    damaged = bytearray(stored)
    damaged[-1] ^= 0xFF
    (tmp_path / member).write_bytes(bytes(damaged))
    stream = storage.stream_read(member, ReadArgs(pre_read_full_file=False))
    with stream, pytest.raises(CheckpointCorruptError, match=rf"bytes 0\.\.{len(stored)}"):
        stream.seek(100)


def test_a_whole_file_read_is_checked_in_the_callers_buffer(tmp_path: Path) -> None:
    """torch_checkpointing's load reads a file with one ``readinto`` the size of the file: the
    bytes land in that buffer and are checked there before the call returns (one copy); a
    damaged or longer file raises from that call; reading again after it still works."""
    _save(tmp_path)
    storage = SafeStorageConfig(tmp_path).create_storage()
    member = Path(NAME) / "model_0.pt"
    stored = (tmp_path / member).read_bytes()
    into = bytearray(len(stored) + 7)
    with storage.stream_read(member) as stream:
        assert stream.readinto(into) == len(stored) and bytes(into[: len(stored)]) == stored
        assert stream.tell() == len(stored) and stream.readinto(bytearray(8)) == 0
        assert stream.seek(0) == 0 and stream.read() == stored

    for damage, match in [(b"\x00", "file size differs"), (None, "checksum mismatch")]:
        bad = stored + damage if damage else bytes([stored[0] ^ 1]) + stored[1:]
        (tmp_path / member).write_bytes(bad)
        with (
            storage.stream_read(member) as stream,
            pytest.raises(CheckpointCorruptError, match=match),
        ):
            stream.readinto(bytearray(len(bad)))


@pytest.mark.parametrize("flip", [None, 0, 999, 1000, -1])
def test_a_whole_file_read_hashes_each_step_as_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flip: int | None
) -> None:
    """The read into the caller's buffer goes a step at a time, each step hashed as it lands:
    the bytes come back exactly, and a byte flipped in any step, or on either side of a step's
    edge, is refused."""
    monkeypatch.setattr(tc_module, "_STEP", 1000)
    _save(tmp_path)
    storage = SafeStorageConfig(tmp_path).create_storage()
    member = Path(NAME) / "model_0.pt"
    stored = bytearray((tmp_path / member).read_bytes())
    assert len(stored) > 3000
    if flip is not None:
        stored[flip] ^= 0x10
        (tmp_path / member).write_bytes(bytes(stored))
    into = bytearray(len(stored))
    with storage.stream_read(member) as stream:
        if flip is None:
            assert stream.readinto(into) == len(stored) and into == stored
        else:
            with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
                stream.readinto(into)


def test_a_fault_mid_read_falls_back_to_the_retried_whole_file_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The straight read into the caller's buffer is one stream (an object store retries its
    open, not each read): a connection lost mid-read reads the file again through the backend's
    retried whole-file read, and the caller still gets checked bytes."""
    _save(tmp_path)
    storage = SafeStorageConfig(tmp_path).create_storage()
    member = Path(NAME) / "model_0.pt"
    stored = (tmp_path / member).read_bytes()

    class _Dropped(io.RawIOBase):
        def readinto(self, buffer: Any) -> int:
            raise ConnectionResetError("connection reset by peer")

    real_open, opened = storage._backend.open_read, []

    @contextlib.contextmanager
    def dropped_once(rel: str) -> Iterator[Any]:
        opened.extend([rel] if rel.endswith("model_0.pt") else [])
        if opened.count(rel) != 1:  # the retry reads the file again (and other files)
            with real_open(rel) as f:
                yield f
        else:
            yield _Dropped()

    monkeypatch.setattr(storage._backend, "open_read", dropped_once)
    into = bytearray(len(stored))
    with storage.stream_read(member) as stream:
        assert stream.readinto(into) == len(stored)
    assert bytes(into) == stored and len(opened) == 2


def test_an_uncommitted_name_does_not_exist(tmp_path: Path) -> None:
    config = manager_config(tmp_path, save="sync")
    config.finalize_callback = None
    mgr = CheckpointManager(config)
    mgr.save(NAME, _payload())
    mgr.close()
    storage = SafeStorageConfig(tmp_path).create_storage()
    assert not storage.exists(Path(NAME))
    with pytest.raises(FileNotFoundError):
        storage.getsize(Path(NAME) / "model_0.pt")
    assert dcp_safe.list_checkpoints(tmp_path) == []


_STRUCTURE = ("open", "close", "pipe", "mkdir", "move", "copy", "remove")


def _faulty_save(root: Path, name: str, seed: int, plan: FaultPlan) -> FaultInjector:
    """Save through ``faulty://`` over ``root``; the injector says what it counted."""
    faults = FaultInjector(plan)
    options = {"target_protocol": "file", "faults": faults}
    _save(f"faulty://{root}", name, seed, storage_options=options)
    return faults


def _kill_points(tmp_path: Path) -> list[FaultPlan]:
    """Every storage operation that changes something in one save, but the data writes, which
    get their first, middle and last (a torn write each)."""
    counted = _faulty_save(tmp_path / "counted", NAME, 0, FaultPlan())
    structure = sum(counted.counts[kind] for kind in _STRUCTURE)
    writes = counted.counts["write"]
    assert structure > 10 and writes > 2
    plans = [FaultPlan(ops=_STRUCTURE, fail_at=k, persistent=True) for k in range(1, structure + 1)]
    plans += [
        FaultPlan(ops=("write",), fail_at=k, persistent=True)
        for k in sorted({1, writes // 2, writes})
    ]
    return plans


def test_a_save_dying_at_any_write_leaves_the_last_committed_one(tmp_path: Path) -> None:
    """Killed at each operation that changes storage (every later one failing too, as after a
    crash): the previous checkpoint still loads, nothing half-written lists or is "latest",
    and a restarted job saves again."""
    for number, plan in enumerate(_kill_points(tmp_path)):
        root = tmp_path / f"kill_{number:03d}"
        previous = _faulty_save(root, "step_000100", 0, FaultPlan()) and _payload(0)
        with contextlib.suppress(Exception):  # the save may fail anywhere, or after its commit
            _faulty_save(root, "step_000200", 1, plan)
        names = [info.name for info in dcp_safe.list_checkpoints(root)]
        assert names in (["step_000100"], ["step_000100", "step_000200"]), (plan, names)
        latest = dcp_safe.verify_checkpoint(root, deep=True).name
        assert latest == names[-1], plan
        _assert_same(_load(root, "step_000100"), previous)
        if "step_000200" in names:
            _assert_same(_load(root, "step_000200"), _payload(1))
        _faulty_save(root, "step_000300", 2, FaultPlan())
        _assert_same(_load(root, dcp_safe.verify_checkpoint(root).name), _payload(2))


# Past the claim (the lease's own open, write and folder come first), into the data files.
@pytest.mark.parametrize(("kind", "at"), [("write", 5), ("open", 2), ("mkdir", 2)])
def test_a_name_is_saved_again_after_a_failed_write(tmp_path: Path, kind: str, at: int) -> None:
    """A failed write gives the save up (its files and its claim: here the lease), so the
    manager's next save of that name begins afresh instead of adding to the dead one, and a
    restarted job takes the name at once."""
    plan = FaultPlan(ops=(kind,), fail_at=at)
    faults = FaultInjector(plan)
    options = {"target_protocol": "file", "faults": faults}
    mgr = _manager(f"faulty://{tmp_path}", storage_options=options)
    try:
        with pytest.raises(Exception):  # noqa: B017 - torch.save may word the I/O error its way
            mgr.save(NAME, _payload(0))
        assert faults.failures[0].path.startswith(f"{tmp_path}/{NAME}")
        assert "_WRITING" not in faults.failures[0].path
        assert dcp_safe.list_checkpoints(tmp_path) == []
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
        mgr.save(NAME, _payload(1))
        faults.reset(plan)
        with pytest.raises(Exception):  # noqa: B017
            mgr.save("step_000200", _payload(2))
    finally:
        mgr.close()
    _faulty_save(tmp_path, "step_000200", 3, FaultPlan())  # the restarted job
    assert [info.name for info in dcp_safe.list_checkpoints(tmp_path)] == [NAME, "step_000200"]
    for name, seed in ((NAME, 1), ("step_000200", 3)):
        # metadata.pkl is written by a manager's first save that gets that far
        # (torch_checkpointing skips it while the layout is unchanged)
        assert dcp_safe.verify_checkpoint(tmp_path, name, deep=True).files_checked in (3, 4)
        _assert_same(_load(tmp_path, name), _payload(seed))


def _rank_save_one_failing(rank: int, world_size: int, root: str, name: str, fail: bool) -> str:
    """Save ``name``; with ``fail``, rank 1's first data file write fails. What each rank saw."""
    plan = FaultPlan(ops=("open",), fail_at=2) if fail and rank == 1 else FaultPlan()
    options = {"target_protocol": "file", "faults": FaultInjector(plan)}
    mgr = CheckpointManager(
        manager_config(f"faulty://{root}", save="sync", storage_options=options, deadline_s=5)
    )
    try:
        mgr.save(name, _payload(rank))
    except Exception as exc:  # what failed on this rank is the result
        return type(exc).__name__
    finally:
        mgr.close()
    return "saved"


@pytest.mark.multiproc
def test_a_rank_failing_mid_save_publishes_nothing(tmp_path: Path) -> None:
    """Rank 1 fails a write: it gives up, rank 0 is told by the deadline (a CommitError, the
    group dropped), nothing is listed, and the next run saves the same name."""
    root = str(tmp_path)
    outcome = run_ranks(_rank_save_one_failing, 2, args=(root, NAME, True), timeout_s=90)
    assert outcome[0] == "CommitError"
    assert outcome[1] != "saved"
    assert dcp_safe.list_checkpoints(tmp_path) == []
    assert run_ranks(_rank_save_one_failing, 2, args=(root, NAME, False)) == ["saved"] * 2
    assert dcp_safe.verify_checkpoint(tmp_path, NAME, deep=True).files_checked == 6


@pytest.mark.s3
def test_replicated_to_a_second_root_it_verifies_and_loads_there(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any]
) -> None:
    saved = _save(tmp_path)
    remote = Root(s3_root, storage_options=s3_options)
    replicate_checkpoint(open_backend(tmp_path), open_backend(remote), NAME)
    assert dcp_safe.verify_checkpoint(remote, NAME, deep=True).files_checked == 4
    mgr = _manager(s3_root, storage_options=s3_options)
    try:
        _assert_same(dict(mgr.load(NAME, into=_template())), saved)
    finally:
        mgr.close()


@pytest.mark.s3
@pytest.mark.subprocess
def test_async_saver_on_s3(s3_root: str, s3_options: dict[str, Any]) -> None:
    saved = _payload(4)
    config = manager_config(s3_root, save="async", storage_options=s3_options)
    mgr = CheckpointManager(config)
    try:
        future = mgr.save(NAME, saved)
        assert future is not None
        future.result(timeout=120)
        _assert_same(dict(mgr.load(NAME, into=_template())), saved)
    finally:
        mgr.close()
    root = Root(s3_root, storage_options=s3_options)
    assert dcp_safe.verify_checkpoint(root, NAME, deep=True).files_checked == 3


def test_retention_and_the_sweeper_handle_these_checkpoints(tmp_path: Path) -> None:
    for seed, name in enumerate(("step_000100", "step_000200", "step_000300")):
        _save(tmp_path, name, seed)
    config = manager_config(tmp_path, save="sync")
    config.finalize_callback = None  # a save that died before its commit: a hidden partial
    mgr = CheckpointManager(config)
    mgr.save("step_000400", _payload(3))
    mgr.close()
    assert any(entry.name.startswith(".step_000400.partial-") for entry in tmp_path.iterdir())

    dcp_safe.apply_retention(tmp_path, keep_last=1, grace_s=0)
    names = [info.name for info in dcp_safe.list_checkpoints(tmp_path)]
    assert names == ["step_000200", "step_000300"]  # the two newest are always kept
    assert sorted(entry.name for entry in tmp_path.iterdir()) == names
    assert dcp_safe.verify_checkpoint(tmp_path, deep=True).name == "step_000300"
    _assert_same(_load(tmp_path, "step_000300"), _payload(2))


def test_a_load_reads_the_manifest_afresh(tmp_path: Path) -> None:
    """One manager, the name retired and saved again by another job: its next load reads the
    new checkpoint, not the manifest it saw before."""
    _save(tmp_path, seed=0)
    mgr = _manager(tmp_path)
    try:
        _assert_same(dict(mgr.load(NAME, into=_template())), _payload(0))
        strategy_for(open_backend(tmp_path)).retire(open_backend(tmp_path), NAME)
        _save(tmp_path, seed=1)
        _assert_same(dict(mgr.load(NAME, into=_template())), _payload(1))
    finally:
        mgr.close()


def test_the_cli_verifies_every_file_and_names_the_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dcp-safe verify`` checks these checkpoints by their bytes and says so: it does not
    claim DCP metadata or items that this format does not have."""
    _save(tmp_path)
    assert cli_main(["verify", str(tmp_path), NAME]) == 0
    out = capsys.readouterr().out
    assert f"OK {NAME}: 4 files, 0 items" in out  # three of its own, one rank manifest
    assert "(torch_checkpointing's files)" in out and "DCP's metadata" not in out


def test_removing_a_checkpoint_unpublishes_it_first_and_single_files_are_never_removed(
    tmp_path: Path,
) -> None:
    """torchtitan's retention removes old checkpoints through ``Storage.rmdir``: that retires
    the checkpoint as dcp_safe's retention does (unpublished in one step, then deleted); a file
    of a committed checkpoint is never deleted on its own."""
    _save(tmp_path, "step_000001", seed=1)
    kept = _save(tmp_path, "step_000002", seed=2)
    storage = SafeStorageConfig(tmp_path).create_storage()
    with pytest.raises(OSError, match="files are removed with the checkpoint"):
        storage.delete(tmp_path / "step_000002" / "step_0.pt")
    with pytest.raises(OSError, match="only a whole checkpoint"):
        storage.rmdir(tmp_path / "step_000002" / "step_0.pt")
    storage.rmdir(tmp_path / "step_000001")
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "step_000002"
    ]
    dcp_safe.verify_checkpoint(tmp_path, "step_000002", deep=True)
    _assert_same(_load(tmp_path, "step_000002"), kept)
