"""The manager under chaos: slow ranks, timeouts and failing bookkeeping never stop a job saving.

One test per finding of the chaos run (issue 26), each on real gloo ranks or a real root:

1. a coordinator busy past the deadline (retention on a slow file system) is waited for by the
   default ``when_busy="wait"``, not taken for a dead peer;
2. ``when_busy="coalesce"`` parks, replaces and starts the same save on every rank;
3. a background save that timed out breaks its gloo group, which is replaced: later saves commit;
5. a history append that fails never leaves a handle unresolved;
7. a history write that fails on the coordinator fails no request on any rank;
8. a prune that fails after unpublishing is in the history; ``close(timeout_s)`` is a bound;
   the upload waits of a manager's writer come from its own bounds.

(4 and 6, the lease of a crashed attempt and the sweeper's markers, are in ``tests/commit`` and
``tests/retention``; the seeded chaos driver is ``tests/e2e/test_chaos.py``.)
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.faults import SlowOnRank

from dcp_safe import (
    Bounds,
    CheckpointManager,
    CommitError,
    Runtime,
    SafeStorageWriter,
    Topology,
    WriterOptions,
    list_checkpoints,
)
from dcp_safe.coordination.groups import ManagerGroups
from dcp_safe.errors import DcpSafeError, DrainTimeoutError
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
from dcp_safe.testing.multiproc import run_ranks

DEADLINE_S = 2.0


def _state(step: int, world_size: int) -> dict[str, Any]:
    """Each rank's own entries under its own keys: every rank writes items in every save."""
    return {f"w{r}": torch.full((64,), float(100 * step + r)) for r in range(world_size)}


def _slow_listing_on_rank0(rank: int, root: str, delay_s: float) -> dict[str, Any]:
    """A root whose listings are slow on rank 0 only: its retention outlasts the deadline."""
    plan = FaultPlan(ops=("list",), delay_s=delay_s if rank == 0 else 0.0)
    return {"target_protocol": "file", "faults": FaultInjector(plan)}


def _outcomes(handles: list[Any]) -> list[tuple[int, str]]:
    """Each handle's outcome, the same words on every rank when the ranks agree."""
    out = []
    for h in handles:
        try:
            h.committed.result(timeout=120)
            out.append((h.step, "committed"))
        except BaseException as exc:
            out.append((h.step, type(exc).__name__))
    return out


def _comparable(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["event"], e["step"], e.get("tier")) for e in events]


# -- 1 and 2: a coordinator busy past the deadline ------------------------------------------


# Rank 0 lists about 9 times a save (2 in the save, 7 in retention's follow-up): at 0.75 s each
# its follow-up (~5 s) outlasts the 2 s deadline more than twice, at half the time 1.5 s took.
LIST_DELAY_S = 0.75


def _busy_coordinator(rank: int, world_size: int, root: str, policy: str) -> dict[str, Any]:
    options = _slow_listing_on_rank0(rank, root, delay_s=LIST_DELAY_S)
    handles = []
    with CheckpointManager(
        Topology.of(f"faulty://{root}", storage_options=options),
        when_busy=policy,
        keep_last=2,
        bounds=Bounds(deadline_s=DEADLINE_S, wait_timeout_s=120),
    ) as manager:
        for step in range(1, 5):
            handle = manager.save(step, _state(step, world_size))
            if handle is not None:
                handles.append(handle)
            time.sleep(0.3)  # the next request comes while rank 0 is still pruning
        manager.wait(120)
        return {
            "outcomes": _outcomes(handles),
            "decisions": _comparable(manager.decisions()),
            "stats": manager.stats(),
        }


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_wait_policy_waits_for_a_coordinator_busy_past_the_deadline(tmp_path: Path) -> None:
    """Finding 1: rank 0's follow-up (retention listings at 0.75 s each) outlasts the 2 s
    deadline; the next request waits for it on every rank, in rounds, and every save commits."""
    results = run_ranks(_busy_coordinator, 2, args=(str(tmp_path), "wait"), timeout_s=240)
    for result in results:
        assert result["outcomes"] == [(s, "committed") for s in range(1, 5)]
        assert result["stats"].waited_s > 0  # rank 0 was busy, and every rank waited
    # Three requests waited (steps 2-4): more than three deadlines in all means at least one
    # wait outlasted the deadline, which is the finding.
    assert results[0]["stats"].waited_s > 3 * DEADLINE_S
    assert results[0]["decisions"] == results[1]["decisions"]
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000000003", "step_000000004"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_coalesce_parks_and_starts_the_same_save_on_every_rank(tmp_path: Path) -> None:
    """Finding 2: with rank 0 busy and rank 1 idle, a coalesced request is parked on both ranks
    and started on both once rank 0 is free (never at once on the idle rank); a pending save
    is replaced on every rank or on none; every rank's handles end alike."""
    results = run_ranks(_busy_coordinator, 2, args=(str(tmp_path), "coalesce"), timeout_s=240)
    assert results[0]["outcomes"] == results[1]["outcomes"]
    assert results[0]["decisions"] == results[1]["decisions"]
    outcomes = dict(results[0]["outcomes"])
    assert outcomes[1] == "committed"
    assert "committed" in {outcomes[s] for s in outcomes if s > 1}  # a coalesced one committed
    assert set(outcomes.values()) <= {"committed", "CancelledError"}  # nothing failed
    assert results[0]["stats"].coalesced >= 1
    newest = list_checkpoints(tmp_path)[-1].step
    assert outcomes[newest] == "committed"


# -- 3: one timeout does not break every later save -----------------------------------------


def _one_timeout(rank: int, world_size: int, root: str) -> dict[str, Any]:
    handles = []
    # Storage slow on rank 1 for one save: its part outlasts the deadline, once.
    writer = SlowOnRank(root, slow_rank=1, delay_s=3 * DEADLINE_S, at_step=2)
    manager = CheckpointManager(
        root,
        keep_last=5,
        bounds=Bounds(deadline_s=DEADLINE_S, wait_timeout_s=120),
        runtime=Runtime(writer=writer),
    )
    for step in range(1, 6):
        handle = manager.save(step, _state(step, world_size))
        assert handle is not None
        handles.append(handle)
    errors = []
    for h in handles:
        try:
            h.committed.result(timeout=120)
            errors.append(None)
        except BaseException as exc:
            errors.append(exc)
    with contextlib.suppress(DcpSafeError):  # the kept error of step 2, raised once more
        manager.close(60)
    return {"errors": errors, "stats": manager.stats(), "decisions": manager.decisions()}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_save_that_timed_out_breaks_no_later_save(tmp_path: Path) -> None:
    """Finding 3: step 2 times out (rank 1's storage is slow for that save only). It fails on
    both ranks with a CommitError naming ranks, never a raw RuntimeError; the broken background
    group is replaced at the next request, and steps 3-5 commit on every rank."""
    results = run_ranks(_one_timeout, 2, args=(str(tmp_path),), timeout_s=240)
    for result in results:
        errors = result["errors"]
        assert errors[0] is None
        assert isinstance(errors[1], CommitError) and errors[1].failures
        assert errors[2:] == [None, None, None]
    assert sum(r["stats"].groups_broken for r in results) >= 1
    assert _comparable(results[0]["decisions"]) == _comparable(results[1]["decisions"])
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 3, 4, 5]


# -- 5 and 7: bookkeeping that fails ----------------------------------------------------------


def _history_unwritable(root: Path) -> None:
    """A directory where the history file goes: every append fails (as on a full disk)."""
    (root / "_history.jsonl").mkdir(parents=True)


def test_a_failed_history_append_still_resolves_every_handle(tmp_path: Path) -> None:
    """Finding 5: the history cannot be appended to; a save still commits and one whose
    storage fails still fails its handle (with the storage's typed error), and nothing hangs."""
    _history_unwritable(tmp_path)
    faults = FaultInjector(FaultPlan(ops=("write",), fail_at=1))  # the second save's first write
    options = {"target_protocol": "file", "faults": faults}
    with CheckpointManager(tmp_path, keep_last=3) as manager:
        committed = manager.save(1, {"w": torch.ones(8)})
        assert committed is not None
        assert committed.committed.result(timeout=60) == "step_000000001"
        assert manager.stats().bookkeeping_failures >= 2  # "requested" and "committed"
    failing = CheckpointManager(
        Topology.of(f"faulty://{tmp_path}", storage_options=options), keep_last=3
    )
    handle = failing.save(2, {"w": torch.ones(8)})
    assert handle is not None
    with pytest.raises(DcpSafeError):
        handle.committed.result(timeout=60)  # resolved, never left pending
    with pytest.raises(DcpSafeError):
        failing.close(60)
    assert failing.stats().failed == 1


def _unwritable_history(rank: int, world_size: int, root: str) -> dict[str, Any]:
    with CheckpointManager(root, keep_last=2, bounds=Bounds(deadline_s=DEADLINE_S)) as manager:
        handles = []
        for step in range(1, 4):
            handle = manager.maybe_save(step, _state(step, world_size))  # never raises here
            assert handle is not None
            handles.append(handle)
            handle.committed.result(timeout=120)
        return {
            "outcomes": _outcomes(handles),
            "decisions": _comparable(manager.decisions()),
            "stats": manager.stats(),
        }


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_failed_history_write_on_the_coordinator_fails_no_request(tmp_path: Path) -> None:
    """Finding 7: only rank 0 writes the history, and every write fails; no request fails on
    rank 0 alone (its peers would take it for dead): every save commits on every rank, and the
    failures are counted on the coordinator."""
    _history_unwritable(tmp_path)
    results = run_ranks(_unwritable_history, 2, args=(str(tmp_path),), timeout_s=240)
    for result in results:
        assert result["outcomes"] == [(1, "committed"), (2, "committed"), (3, "committed")]
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["stats"].bookkeeping_failures > 0
    assert results[1]["stats"].bookkeeping_failures == 0  # rank 1 writes no history


# -- 8: the lower findings --------------------------------------------------------------------


def test_a_prune_that_fails_after_unpublishing_is_recorded(tmp_path: Path) -> None:
    """Finding 8a: retention unpublishes a checkpoint (its marker), then cannot delete its files;
    the checkpoint is gone from the listing, and the history says it was pruned, and why."""
    faults = FaultInjector()
    options = {"target_protocol": "file", "faults": faults}
    # The faults are planned in this process: the save's commit runs on its thread.
    manager = CheckpointManager(
        Topology.of(f"faulty://{tmp_path}", storage_options=options),
        keep_last=1,
        runtime=Runtime(executor="thread"),
    )
    for step in (1, 2, 3):  # the two newest validated are always kept: step 3 prunes step 1
        if step == 3:
            # This root publishes by marker: step 3 removes its lease after its marker (remove
            # 1), retention removes step 1's marker (remove 2), then cannot remove its files.
            faults.reset(FaultPlan(ops=("remove",), fail_at=3, persistent=True))
        handle = manager.save(step, {"w": torch.full((8,), float(step))})
        assert handle is not None
        handle.committed.result(timeout=60)  # the prune's failure is kept, not the save's
    with pytest.raises(OSError, match="injected fault"):
        manager.close(60)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000000002", "step_000000003"]
    pruned = [e for e in manager.history() if e["event"] == "pruned"]
    assert [e["name"] for e in pruned] == ["step_000000001"]
    assert "unpublished, but removing its files failed" in pruned[0]["reason"]


def test_close_returns_by_its_timeout_whatever_a_step_does(tmp_path: Path) -> None:
    """Finding 8b: the last prune lists a root whose every listing takes 20 s; close(0.5)
    raises DrainTimeoutError long before one listing could end (the work goes on behind)."""
    faults = FaultInjector(FaultPlan(ops=("list",), delay_s=0.0))
    options = {"target_protocol": "file", "faults": faults}
    manager = CheckpointManager(
        Topology.of(f"faulty://{tmp_path}", storage_options=options), keep_last=1
    )
    handle = manager.save(1, {"w": torch.ones(8)})
    assert handle is not None
    handle.committed.result(timeout=60)
    faults.reset(FaultPlan(ops=("list",), delay_s=20.0))
    started = time.monotonic()
    with pytest.raises(DrainTimeoutError, match=r"close did not finish within 0\.5 s"):
        manager.close(0.5)
    assert time.monotonic() - started < 20.0
    faults.release()


def test_a_managers_upload_waits_come_from_its_own_bounds(tmp_path: Path) -> None:
    """Finding 8c: the per-rank upload waits of the writer a manager builds follow its
    ``wait_timeout_s`` (they were 1800 s whatever the manager said)."""
    with CheckpointManager(
        Topology.of(tmp_path / "local", replicate_to=tmp_path / "replica"),
        bounds=Bounds(wait_timeout_s=42),
    ) as replicated:
        assert replicated.writer.replication_options.remote_timeout_s == 42
    with CheckpointManager(
        Topology.of(tmp_path / "remote", node_local=tmp_path / "node"),
        bounds=Bounds(wait_timeout_s=43),
    ) as node_local:
        options = node_local.writer.node_options  # type: ignore[attr-defined]
        assert options.remote_timeout_s == 43


def test_a_close_that_gives_up_resolves_every_handle_it_leaves_behind(tmp_path: Path) -> None:
    """Finding 8 (and the chaos run's handles_resolve): storage stuck for 20 s a write; close(0.5)
    raises DrainTimeoutError by its deadline and the handle's futures end with it, so no
    caller waits for ever on work that goes on in the background."""
    faults = FaultInjector(FaultPlan(ops=("write",), delay_s=20.0))
    options = {"target_protocol": "file", "faults": faults}
    manager = CheckpointManager(Topology.of(f"faulty://{tmp_path}", storage_options=options))
    handle = manager.save(1, {"w": torch.ones(8)})
    assert handle is not None and not handle.committed.done()
    with pytest.raises(DrainTimeoutError):
        manager.close(0.5)
    assert handle.committed.done() and handle.replicated.done()
    with pytest.raises(DrainTimeoutError):
        handle.committed.result(timeout=0)
    faults.release()  # the write left behind ends now, not at interpreter exit


def _construct_with_a_late_peer(rank: int, world_size: int) -> dict[str, Any]:
    if rank == 1:
        # Never joins: run_ranks keeps this rank alive, outside the groups, until rank 0 is done
        # (past its deadline), which is what a rank arriving late looks like to rank 0.
        return {}
    try:
        ManagerGroups(2.0)  # what CheckpointManager builds first, on every rank
    except CommitError as exc:
        return {"error": str(exc), "failures": dict(exc.failures)}
    return {"error": None}


@pytest.mark.multiproc
def test_a_peer_that_does_not_join_the_managers_groups_is_a_typed_error_naming_it() -> None:
    """Chaos seed 4017: under load, a rank reached the manager's construction more than
    ``deadline_s`` after the others, and ``CheckpointManager(...)`` raised gloo's raw
    ``RuntimeError`` on some ranks and ``DistStoreError`` on the rest."""
    first, _ = run_ranks(_construct_with_a_late_peer, 2, timeout_s=120)
    assert first["error"] is not None, "the groups were created without rank 1"
    assert "could not create the manager's" in first["error"]
    assert list(first["failures"]) == [1]


def _events_of(manager: CheckpointManager, step: int) -> list[tuple[str, str]]:
    return [(e["event"], e["tier"]) for e in manager.decisions() if e["step"] == step]


def test_a_request_that_raises_ends_in_a_recorded_failure_at_once(tmp_path: Path) -> None:
    """Chaos seed 10083: after a group replacement failed, every rank's ``maybe_save`` raised,
    but the request stayed open ("requested", no outcome, the handle's futures pending) until a
    close gave up on it, which only the ranks whose close timed out did: the ranks' records of
    the same steps differed. The request now ends in one "failed" event when it raises."""
    manager = CheckpointManager(
        tmp_path,
        runtime=Runtime(writer=SafeStorageWriter(tmp_path, options=WriterOptions(fsync=False))),
    )

    def broken_vote(*args: Any, **kwargs: Any) -> Any:
        raise CommitError("the manager's group broke (injected)", failures={1: "gone"})

    manager._runner.admit = broken_vote  # type: ignore[method-assign]
    with pytest.raises(CommitError):
        manager.save(1, {"w": torch.ones(4)})
    assert _events_of(manager, 1) == [("requested", "local"), ("failed", "local")]
    manager.close(5.0)  # nothing left open: no DrainTimeoutError, no second record
    assert _events_of(manager, 1) == [("requested", "local"), ("failed", "local")]


def test_a_save_given_up_by_close_before_its_commit_is_recorded_as_a_failed_save(
    tmp_path: Path,
) -> None:
    """The other half of seed 10083: a close that gives up on a save still in flight records
    it as a failed save (one event, as a save that failed is recorded), not as a failed save
    and a failed replication, so its ranks agree with a peer whose save failed outright."""
    faults = FaultInjector(FaultPlan(ops=("write",), delay_s=20.0))
    options = {"target_protocol": "file", "faults": faults}
    manager = CheckpointManager(
        Topology.of(
            f"faulty://{tmp_path / 'local'}",
            storage_options=options,
            replicate_to=str(tmp_path / "remote"),
        )
    )
    handle = manager.save(1, {"w": torch.ones(8)})
    assert handle is not None
    with pytest.raises(DrainTimeoutError):
        manager.close(0.5)
    assert handle.committed.done() and handle.replicated.done()
    assert _events_of(manager, 1) == [("requested", "local"), ("failed", "local")]
    faults.release()
