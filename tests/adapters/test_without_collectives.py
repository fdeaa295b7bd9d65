"""Saves with ``use_collectives=False``: the ranks agree and report through storage.

Real gloo ranks (``run_ranks``) save through torch's own ``dcp.save`` and through
``dcp_safe.save``; rank functions return what they saw and the assertions run here. Rules under
test: docs/multirank.md, "Saves without collectives".
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from support import assert_state_equal, blank_tree
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcp_safe
from dcp_safe import (
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    SafeSavePlanner,
    SafeStorageReader,
    SafeStorageWriter,
    layout,
    verify_checkpoint,
)
from dcp_safe.adapters.node_local import NodeLocalWriter
from dcp_safe.adapters.options import WriterOptions
from dcp_safe.adapters.without_collectives import StorageAgreement, save_key
from dcp_safe.backends.roots import open_backend
from dcp_safe.commit.fencing import Attempt
from dcp_safe.errors import DivergentStateError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.testing.multiproc import RankFailedError, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

# How long a save waits on storage for a peer in these tests: far above a healthy peer's lag on
# a loaded host, and what a test with a dead rank waits before the coordinator gives up.
REPORT_TIMEOUT_S = 8.0
PER_RANK = ("rng",)


def _options() -> WriterOptions:
    return WriterOptions(report_timeout_s=REPORT_TIMEOUT_S)


def _rank_state(rank: int, seed: int = 0) -> dict[str, Any]:
    """Keys of this rank's own (sharded by key), replicated state, and per-rank state."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return {
        f"rank{rank}.weight": torch.randn(4, 3, generator=gen),
        f"rank{rank}.extra": {"owner": rank, "history": [seed, rank]},
        "shared.bias": torch.arange(5, dtype=torch.float32) + seed,
        "shared.config": {"epochs": 3, "seed": seed},
        "rng": torch.full((3,), float(rank + 10 * seed)),
    }


def _manifest(root: Path, name: str) -> Manifest:
    path = root / name / layout.MANIFEST
    return Manifest.from_json(path.read_bytes(), str(path))


def _load_on_rank(root: str, name: str, rank: int) -> list[str]:
    """Load ``name`` into a blank copy of this rank's state: the keys that differ."""
    expected = _rank_state(rank)
    target = blank_tree(expected)
    dcp_safe.load(
        target,
        checkpoint_id=name,
        storage_reader=SafeStorageReader(root),
        per_rank=PER_RANK,
        audit=True,
    )
    return [k for k in expected if not _equal(target[k], expected[k])]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


# --------------------------------------------------------------- rank functions (module level)


def _save_both_ways(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    dcp.save(
        _rank_state(rank),
        storage_writer=SafeStorageWriter(root, options=_options()),
        checkpoint_id="via_torch",
        planner=SafeSavePlanner(per_rank=PER_RANK),
        use_collectives=False,
    )
    dcp_safe.save(
        _rank_state(rank),
        storage_writer=SafeStorageWriter(root, options=_options()),
        checkpoint_id="via_dcp_safe",
        per_rank=PER_RANK,
        use_collectives=False,
    )
    dcp_safe.async_save(
        _rank_state(rank),
        storage_writer=SafeStorageWriter(root, options=_options()),
        checkpoint_id="via_async",
        per_rank=PER_RANK,
        use_collectives=False,
    ).result()
    dist.barrier()  # every save published before any rank loads
    return {name: _load_on_rank(root, name, rank) for name in ("via_torch", "via_dcp_safe")}


def _dtensor_state(mesh: DeviceMesh, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "dt.sharded": distribute_tensor(torch.randn(5, 4, generator=gen), mesh, [Shard(0)]),
        "dt.replicated": distribute_tensor(torch.randn(3, generator=gen), mesh, [Replicate()]),
    }


def _save_dtensors(rank: int, world_size: int, root: str) -> list[str]:
    mesh = DeviceMesh("cpu", list(range(world_size)))
    state = _dtensor_state(mesh, seed=1)
    dcp_safe.save(
        state,
        storage_writer=SafeStorageWriter(root, options=_options()),
        checkpoint_id="dtensors",
        use_collectives=False,
    )
    dist.barrier()
    target = {
        key: distribute_tensor(torch.zeros(value.shape), mesh, value.placements)
        for key, value in state.items()
    }
    # audit=True: the fingerprints rank 0 merged from the ranks' reports match the live state.
    dcp_safe.load(
        target, checkpoint_id="dtensors", storage_reader=SafeStorageReader(root), audit=True
    )
    loaded = {key: target[key] for key in state if isinstance(target[key], DTensor)}
    return [k for k, v in state.items() if not torch.equal(loaded[k].to_local(), v.to_local())]


def _save_entry_rank0_lacks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _rank_state(rank)
    if rank > 0:
        state["late.entry"] = torch.ones(2)  # on ranks 1 and 2 only, not declared per rank
    try:
        dcp_safe.save(
            state,
            storage_writer=SafeStorageWriter(root, options=_options()),
            checkpoint_id="lacking",
            per_rank=PER_RANK,
            use_collectives=False,
            deadline_s=REPORT_TIMEOUT_S,
        )
    except CommitError as exc:
        return {"error": str(exc), "failures": sorted(exc.failures)}
    return {"error": None}


class _DiesBeforeReporting(SafeStorageWriter):
    """Rank ``victim`` is SIGKILLed after its first item: its write_data never finishes."""

    victim = 1

    def _write_item(self, sink: Any, file_name: str, item: Any, planner: Any) -> Any:
        record = super()._write_item(sink, file_name, item, planner)
        if self._rank == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return record


def _save_with_dead_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    try:
        dcp_safe.save(
            _rank_state(rank),
            storage_writer=_DiesBeforeReporting(root, options=_options()),
            checkpoint_id="dead",
            per_rank=PER_RANK,
            use_collectives=False,
        )
    except CommitError as exc:
        return {"error": type(exc).__name__, "failures": exc.failures}
    return {"error": None}


class _FailsOnRankOne(SafeStorageWriter):
    """Storage that fails on rank 1 while it writes its part, while ``failing``."""

    failing = True

    def _write_rank(self, *args: Any) -> Any:
        if self._rank == 1 and self.failing:
            raise OSError(5, "Input/output error (injected)")
        return super()._write_rank(*args)


def _fail_then_retry(rank: int, world_size: int, root: str, planted: str) -> dict[str, Any]:
    """A failed save of "x", then the retry through the same writers; a stale assignment of an
    earlier attempt planted beside them."""
    writer = _FailsOnRankOne(root, options=_options(), attempt=1)
    seen: dict[str, Any] = {}
    try:
        dcp_safe.save(_rank_state(rank), storage_writer=writer, checkpoint_id="x",
                      per_rank=PER_RANK, use_collectives=False)  # fmt: skip
    except CommitError as exc:  # rank 0: rank 1's failure marker, read from storage
        seen["first"] = exc.failures
    except OSError:  # rank 1: its own storage error
        seen["first"] = {1: "injected"}
    writer.failing = False
    dcp_safe.save(_rank_state(rank), storage_writer=writer, checkpoint_id="x",
                  per_rank=PER_RANK, use_collectives=False)  # fmt: skip
    seen["keys"] = [save_key(writer.attempt, 1), save_key(writer.attempt, 2)]
    return seen


def _save_divergent(rank: int, world_size: int, root: str, check: bool) -> str | None:
    state = _rank_state(rank)
    state["shared.bias"] = state["shared.bias"] + rank  # rank 1's copy differs
    try:
        dcp.save(
            state,
            storage_writer=SafeStorageWriter(root, options=_options()),
            checkpoint_id=f"divergent_{check}",
            planner=SafeSavePlanner(per_rank=PER_RANK, check_divergence=check),
            use_collectives=False,
        )
    except DivergentStateError as exc:
        return f"DivergentStateError {sorted(exc.keys)}"
    return None


_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "gather",
    "scatter",
    "broadcast",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "monitored_barrier",
)


@contextmanager
def _counted(calls: Counter[str]) -> Iterator[None]:
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _count_collectives(rank: int, world_size: int, root: str) -> dict[str, dict[str, int]]:
    seen = {}
    for use_collectives in (True, False):
        calls: Counter[str] = Counter()
        with _counted(calls):
            dcp.save(
                _rank_state(rank),
                storage_writer=SafeStorageWriter(root, options=_options()),
                checkpoint_id=f"counted_{use_collectives}",
                planner=SafeSavePlanner(per_rank=PER_RANK),
                use_collectives=use_collectives,
            )
        seen[str(use_collectives)] = dict(calls)
    return seen


# A signed job's key (every rank's writer holds it); a writer of the root does not.
KEY = bytes.fromhex("5a" * 32)


class _SwapsItsManifest(SafeStorageWriter):
    """Rank 1's rank manifest replaced, after its rank wrote it, by other bytes of like items."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        if self._rank == 1:
            assert self._assignment is not None
            path = Path(self.root, self._assignment.work_dir, layout.rank_manifest_name(1))
            path.write_text(json.dumps(json.loads(path.read_bytes()), indent=1))
        return future


def _save_signed_with_a_foreign_part(rank: int, world_size: int, root: str, how: str) -> Any:
    """A signed job whose rank 1's part is not what rank 1 wrote: "planted" by a writer of the
    root without the key (its value for rank 1's tensor), or rank 1's manifest "swapped"."""
    state, key = _rank_state(rank), KEY
    if how == "planted" and rank == 1:
        key, state["rank1.weight"] = None, torch.full((4, 3), 666.0)
    writer_type = _SwapsItsManifest if how == "swapped" else SafeStorageWriter
    options = WriterOptions(report_timeout_s=REPORT_TIMEOUT_S, checksum="blake3", signing_key=key)
    try:
        dcp_safe.save(state, storage_writer=writer_type(root, options=options),
                      checkpoint_id="signed", per_rank=PER_RANK, use_collectives=False,
                      deadline_s=REPORT_TIMEOUT_S)  # fmt: skip
    except CommitError as exc:
        return {"error": str(exc), "failures": sorted(exc.failures)}
    return {"error": None}


# --------------------------------------------------------------- tests


def test_two_ranks_save_without_collectives_and_load_back_exactly(tmp_path: Path) -> None:
    mismatches = run_ranks(_save_both_ways, 2, args=(str(tmp_path),))
    assert mismatches == [{"via_torch": [], "via_dcp_safe": []}] * 2
    for name in ("via_torch", "via_dcp_safe", "via_async"):
        verify_checkpoint(tmp_path, name, deep=True)
        manifest = _manifest(tmp_path, name)
        assert manifest.world_size == 2
        # Replicated entries once, from rank 0; each rank's own keys and per-rank state its own.
        writers = {item.fqn: item.file for item in manifest.items}
        assert Counter(item.fqn for item in manifest.items)["shared.bias"] == 1
        assert writers["shared.bias"].startswith("__0_") and writers["rank1.weight"].startswith(
            "__1_"
        )
        assert writers[layout.per_rank_key("rng", 1)].startswith("__1_")
        assert not [e for e in os.listdir(tmp_path) if layout.ASSIGNMENT_INFIX in e]
        assert not [e for e in os.listdir(tmp_path / name / layout.RANKS_DIR) if "report" in e]
    # torch's own reader loads it too (the keys every rank would ask for).
    plain = {k: v for r in (0, 1) for k, v in _rank_state(r).items() if k != "rng"}
    target = blank_tree(plain)
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "via_torch"), no_dist=True)
    assert_state_equal(target, plain)


def test_dtensor_shards_are_written_by_their_rank_and_replicas_once(tmp_path: Path) -> None:
    assert run_ranks(_save_dtensors, 2, args=(str(tmp_path),)) == [[], []]
    manifest = _manifest(tmp_path, "dtensors")
    files = sorted((item.fqn, item.file[:4]) for item in manifest.items)
    assert files == [("dt.replicated", "__0_"), ("dt.sharded", "__0_"), ("dt.sharded", "__1_")]
    verify_checkpoint(tmp_path, "dtensors", deep=True)


def test_three_ranks_save_without_collectives(tmp_path: Path) -> None:
    mismatches = run_ranks(_save_both_ways, 3, args=(str(tmp_path),))
    assert mismatches == [{"via_torch": [], "via_dcp_safe": []}] * 3
    assert _manifest(tmp_path, "via_dcp_safe").world_size == 3


def test_a_plain_entry_several_ranks_hold_but_rank_0_lacks_is_refused(tmp_path: Path) -> None:
    seen = run_ranks(_save_entry_rank0_lacks, 3, args=(str(tmp_path),))
    # Rank 0 names both writers; the others learn of it from DCP's final barrier.
    assert "late.entry" in seen[0]["error"] and seen[0]["failures"] == [1, 2]
    assert all(s["error"] for s in seen[1:])
    assert not list(tmp_path.rglob(layout.COMMITTED_MARKER))


def test_a_rank_that_dies_fails_the_coordinator_naming_it(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as failed:
        run_ranks(_save_with_dead_rank, 2, args=(str(tmp_path),), failure_grace_s=90.0)
    assert failed.value.rank == 1
    coordinator = failed.value.results[0]
    assert coordinator["error"] == "CommitError" and list(coordinator["failures"]) == [1]
    assert not list(tmp_path.rglob(layout.COMMITTED_MARKER))


def test_a_failed_save_and_a_stale_assignment_are_not_reused(tmp_path: Path) -> None:
    stale_key = save_key(Attempt(number=0), 1)  # an earlier attempt's first save, crashed
    planted = tmp_path / layout.assignment_file_name("x", stale_key)
    planted.write_text(
        json.dumps(
            {"format": "dcp_safe/assignment", "save_id": "f" * 32, "world_size": 2, "plain": []}
        )
    )
    seen = run_ranks(_fail_then_retry, 2, args=(str(tmp_path), str(planted)))
    assert list(seen[0]["first"]) == [1]  # the coordinator named the failed rank
    assert seen[0]["keys"][0] != stale_key
    manifest = _manifest(tmp_path, "x")
    assert manifest.save_id != "f" * 32
    verify_checkpoint(tmp_path, "x", deep=True)
    assert planted.exists()  # another attempt's: left alone, never read


def test_divergent_replicated_values_are_refused(tmp_path: Path) -> None:
    seen = run_ranks(_save_divergent, 2, args=(str(tmp_path), True))
    assert seen == ["DivergentStateError ['shared.bias']"] * 2
    assert not (tmp_path / "divergent_True" / layout.COMMITTED_MARKER).exists()
    # Without the check, rank 0's copy is kept, as DCP keeps one copy.
    assert run_ranks(_save_divergent, 2, args=(str(tmp_path), False)) == [None, None]
    verify_checkpoint(tmp_path, "divergent_False", deep=True)


def test_a_save_without_collectives_makes_only_dcps_final_barrier(tmp_path: Path) -> None:
    seen = run_ranks(_count_collectives, 2, args=(str(tmp_path),))
    for counts in seen:
        assert counts["False"] == {"barrier": 1}
        assert sum(counts["True"].values()) > 1  # the same count does see planning collectives


def test_one_process_without_collectives_leaves_nothing_behind(tmp_path: Path) -> None:
    state = _rank_state(0)
    dcp_safe.save(
        state,
        storage_writer=SafeStorageWriter(tmp_path),
        checkpoint_id="solo",
        no_dist=True,
        use_collectives=False,
    )
    target = blank_tree(state)
    dcp_safe.load(target, checkpoint_id="solo", storage_reader=SafeStorageReader(tmp_path))
    assert_state_equal(target, state)
    assert sorted(os.listdir(tmp_path)) == ["solo"]


def test_repeated_saves_without_collectives_plan_whole_and_a_caching_planner_is_refused(
    tmp_path: Path,
) -> None:
    state, writer = _rank_state(0), SafeStorageWriter(tmp_path)
    for name in ("first", "second"):  # dcp_safe.save's planner does not cache without collectives
        dcp_safe.save(
            state, storage_writer=writer, checkpoint_id=name, no_dist=True, use_collectives=False
        )
    planner = SafeSavePlanner()  # caches: its second plan of this layout comes without items
    dcp_safe.save(
        state, storage_writer=writer, checkpoint_id="third", no_dist=True, planner=planner
    )
    with pytest.raises(ConfigError, match="cache_plans=False"):
        dcp.save(
            state,
            storage_writer=writer,
            checkpoint_id="fourth",
            no_dist=True,
            planner=planner,
            use_collectives=False,
        )
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path)] == ["first", "second", "third"]


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_the_report_timeout_is_a_finite_positive_number(timeout: Any) -> None:
    with pytest.raises(ConfigError, match="report_timeout_s"):
        WriterOptions(report_timeout_s=timeout)


def test_node_local_writer_refuses_saves_without_collectives(tmp_path: Path) -> None:
    writer = NodeLocalWriter(tmp_path / "node", remote=str(tmp_path / "remote"))
    with pytest.raises(ConfigError, match="use_collectives=True"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)


def test_a_signed_save_without_collectives_commits_and_verifies_with_the_key(
    tmp_path: Path,
) -> None:
    seen = run_ranks(_save_signed_with_a_foreign_part, 2, args=(str(tmp_path), "honest"))
    assert seen == [{"error": None}] * 2
    report = verify_checkpoint(tmp_path, "signed", deep=True, signing_key=KEY)
    assert report.items_checked == len(_manifest(tmp_path, "signed").items)
    assert not [e for e in os.listdir(tmp_path / "signed" / layout.RANKS_DIR) if "report" in e]


@pytest.mark.parametrize(
    ("how", "refusal"),
    [("planted", "not authenticated by the job's signing key"), ("swapped", "not the one")],
)
def test_a_signed_save_refuses_a_rank_part_its_rank_did_not_write(
    tmp_path: Path, how: str, refusal: str
) -> None:
    seen = run_ranks(_save_signed_with_a_foreign_part, 2, args=(str(tmp_path), how))
    assert refusal in seen[0]["error"] and seen[0]["failures"] == [1]
    assert not list(tmp_path.rglob(layout.COMMITTED_MARKER))
    with pytest.raises(CheckpointNotFoundError):  # nothing that loads with the job's key
        SafeStorageReader(tmp_path, signing_key=KEY).reset(layout.LATEST)


def test_a_signed_save_takes_only_an_assignment_the_key_authenticates(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    publication = SafeStorageWriter(tmp_path)._publication

    def board(key: bytes | None) -> StorageAgreement:
        options = WriterOptions(report_timeout_s=0.2, checksum="blake3", signing_key=key)
        return StorageAgreement(backend, "x", "run-1-1", options, publication)

    signed = board(KEY)
    # Planted by a writer of the root without the key: another save id, rank 0 "holding" w.
    planted = {"format": "dcp_safe/assignment", "save_id": "f" * 32, "world_size": 2}
    (tmp_path / signed.path).write_text(json.dumps({**planted, "plain": [["w", None]]}))
    with pytest.raises(CommitError, match="no save id from rank 0"):
        signed.take(2)
    signed.post("a" * 32, 2, {})  # rank 0's own post replaces it
    assert signed.take(2) == ("a" * 32, {})
    assert board(None).take(2) == ("a" * 32, {})  # a reader without the key still reads it


@pytest.mark.parametrize("plain", [[1, 2], [["w"]], [["w", "f"]], [[3, None]], {"w": None}])
def test_a_malformed_assignment_is_a_commit_error_naming_rank_0(tmp_path: Path, plain: Any) -> None:
    # An unsigned assignment file is anyone's to write: whatever its entries, the ranks get the
    # typed error naming rank 0, not a bare TypeError from unpacking them.
    options = WriterOptions(report_timeout_s=0.2)
    board = StorageAgreement(
        open_backend(str(tmp_path)),
        "x",
        "run-1-1",
        options,
        SafeStorageWriter(tmp_path)._publication,
    )
    body = {"format": "dcp_safe/assignment", "save_id": "a" * 32, "world_size": 2, "plain": plain}
    (tmp_path / board.path).write_text(json.dumps(body))
    with pytest.raises(CommitError, match="does not fit this save") as seen:
        board.take(2)
    assert list(seen.value.failures) == [0]
