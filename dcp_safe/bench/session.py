"""One contender's *session*: a cold save, a warm save and two back-to-back save requests.

A session creates the contender (its stager, its pool), saves the same live state several
times and closes it, all under one :class:`~dcp_safe.bench.measure.RssSampler`. Memory is
measured against the RSS just before the contender was created (the training state is already
resident), so a stager's retained pool counts against it, as it would in a training process.

Per save it records:

* ``stall_s``: the call until the live state may change (what the training loop waits);
* ``local_commit_s``: the call until the writer's upload future resolves;
* ``remote_commit_s``: the call until the remote tier is committed (replication, or the writer
  itself when its root is remote);
* ``alloc_bytes``: RSS growth from just before the call to the end of the stall (the host
  memory the save allocated to stage);
* ``peak_over_state_bytes``: the highest RSS during the save above the session's baseline.

Then (``pair=True``) two saves are requested back to back, the second as soon as the first
call's stall ends, and the session records both stalls and the peak over the pair.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from dcp_safe.bench.measure import RssSampler, State
from dcp_safe.bench.savers import Saver, Started

Record = dict[str, float]


def _stamp(future: Future[Any], start: float, into: Record, key: str) -> None:
    def done(_: Future[Any]) -> None:
        into[key] = time.perf_counter() - start

    future.add_done_callback(done)


def _begin(saver: Saver, state: State, name: str, sampler: RssSampler) -> tuple[Started, Record]:
    writer = saver.writer_for(name)
    record: Record = {}
    before = sampler.rss()
    start = time.perf_counter()
    started = saver.call(state, name, writer)
    if started.staged is not None:
        started.staged.result()
    record["stall_s"] = time.perf_counter() - start
    record["alloc_bytes"] = float(sampler.rss() - before)
    record["_start"] = start
    _stamp(started.upload, start, record, "local_commit_s")
    return started, record


def _stamped(future: Future[Any], record: Record, key: str, timeout_s: float) -> None:
    """Wait for ``future`` and for its done-callback, which may run just after ``result()``
    returns (``concurrent.futures`` wakes waiters before it invokes callbacks)."""
    future.result(timeout=timeout_s)
    deadline = time.monotonic() + 10.0
    while key not in record:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the done-callback that records {key} never ran")
        time.sleep(0.0005)


def _finish(saver: Saver, started: Started, record: Record, timeout_s: float) -> Record:
    _stamped(started.upload, record, "local_commit_s", timeout_s)
    if started.remote is not None:
        remote = started.remote()
        _stamp(remote, record["_start"], record, "remote_commit_s")
        _stamped(remote, record, "remote_commit_s", timeout_s)
    elif saver.remote_root:
        record["remote_commit_s"] = record["local_commit_s"]
    del record["_start"]
    return record


def run_session(
    make_saver: Callable[[], Saver],
    state: State,
    *,
    names: Callable[[int], str],
    sampler: RssSampler,
    saves: int = 2,
    pair: bool = True,
    cleanup: Callable[[str], None] | None = None,
    keep_last: bool = False,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run one session; see the module docstring.

    Args:
        make_saver: builds the contender (its stager is created inside the session).
        state: the live state to save, already resident.
        names: checkpoint name of the i-th save (1-based).
        sampler: the running RSS sampler.
        saves: sequential saves, each waited for fully before the next.
        pair: then request two saves back to back.
        cleanup: called with each checkpoint's name once it is no longer needed.
        keep_last: leave the last sequential save's checkpoint for a load measurement.
        timeout_s: the longest a save may take (a hang guard, not a threshold).

    Returns:
        ``{"saves": [Record, ...], "pair": {...}, "baseline_rss_bytes": int}``.
    """
    baseline = sampler.rss()
    saver = make_saver()
    out: dict[str, Any] = {"baseline_rss_bytes": baseline, "saves": []}
    try:
        for i in range(1, saves + 1):
            sampler.take_peak()
            started, record = _begin(saver, state, names(i), sampler)
            out["saves"].append(_finish(saver, started, record, timeout_s))
            record["peak_over_state_bytes"] = float(sampler.take_peak() - baseline)
            if cleanup is not None and not (keep_last and i == saves):
                cleanup(names(i))
        if pair:
            out["pair"] = _pair(saver, state, names, saves, sampler, baseline, timeout_s)
            if cleanup is not None:
                cleanup(names(saves + 1))
                cleanup(names(saves + 2))
    finally:
        saver.close()
    return out


def _pair(
    saver: Saver,
    state: State,
    names: Callable[[int], str],
    done: int,
    sampler: RssSampler,
    baseline: int,
    timeout_s: float,
) -> Record:
    sampler.take_peak()
    first, rec1 = _begin(saver, state, names(done + 1), sampler)
    second, rec2 = _begin(saver, state, names(done + 2), sampler)
    offset = rec2["_start"] - rec1["_start"]
    _finish(saver, first, rec1, timeout_s)
    _finish(saver, second, rec2, timeout_s)
    return {
        "first_stall_s": rec1["stall_s"],
        "second_stall_s": rec2["stall_s"],
        "both_committed_s": max(rec1["local_commit_s"], offset + rec2["local_commit_s"]),
        "peak_over_state_bytes": float(sampler.take_peak() - baseline),
    }


def remove_tree(root: Path) -> Callable[[str], None]:
    """A ``cleanup`` that deletes ``root/<name>`` (and nothing else)."""

    def cleanup(name: str) -> None:
        shutil.rmtree(root / name, ignore_errors=True)

    return cleanup
