"""A save killed at any point never publishes a broken checkpoint and never harms the last one.

The sweep: ``step_1`` is committed; then, for kill point N = 1, 2, ... a forked child saves
``step_2`` and kills itself just before its N-th storage operation (file create, write, half of
a large write, fsync, mkdir, rename, unlink; and, under the CheckpointManager, each tensor the
stager copies), until a save finishes without reaching N. After each kill the parent checks the
root as a restarted job would see it:

* every visible entry is a committed checkpoint, and every listed checkpoint verifies;
* ``step_1`` loads bit for bit; ``step_2`` is absent or loads bit for bit as the new values;
  ``latest`` is the newest of them;
* a fresh save succeeds (leftovers never block the next save).

A failed check is counted as a corrupt publish (a listed checkpoint that does not verify or does
not load as what was saved) or a last-good loss (``step_1`` gone or changed, while no newer
checkpoint replaced it); the sweep runs to the end and then fails with the first messages.

Kills are SIGKILL, or ``os._exit`` (the process ends itself without unwinding). The same holds
for ``overwrite=True`` (the name always holds the old or the new checkpoint, whole), for the
CheckpointManager (kills during staging, the save, its verification, retention pruning ``step_1``
and replication to a second local root), for torch_checkpointing's sync saver on a dcp_safe
root (``dcp_safe.torch_checkpointing``), and for processes of their own (forked from a fork
server that imported torch and ran nothing else) killed by the parent at a random moment of a save
loop.

SIGKILL leaves the page cache alone, so these kills do not lose unsynced writes; the durability
test at the end checks the fsync order that makes a power cut behave the same.

Default run (>= 300 fork kill points, 10 killed save loops): every 4th of torch.save's small shard
writes for one thread, every 8th for two threads, every operation for two threads with zstd, for
overwrite (two threads, zstd), for ``os._exit`` (one thread, zstd), and for the manager every
8th bulk write, then every 3rd kill point, and torch_checkpointing every 8th small write.
``DCP_SAFE_LONG=1`` adds every operation for all five writer configurations in each sweep
(SIGKILL, ``os._exit``, overwrite) and for the manager with three of them (and ``os._exit``
with one), and 100 killed save loops: over ten times the default in each.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import select
import shutil
import signal
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
from _crash import (
    CHILD_DONE,
    CHILD_EXITED,
    blank_like,
    fork_and_wait,
    install_kill_switch,
    is_bit_exact,
    load_values,
    make_values,
    record_figures,
    save_loop,
    save_values,
    start_fork,
    wait_fork,
)

import dcp_safe
import dcp_safe.manager
from dcp_safe import (
    Bounds,
    CheckpointManager,
    FallbackOptions,
    Retention,
    Runtime,
    SavePolicy,
    layout,
)
from dcp_safe.backends import local_backend
from dcp_safe.checkpoints.history import HISTORY_FILE
from dcp_safe.testing.rank_start import rank_context

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

LONG_ONLY = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DCP_SAFE_LONG") != "1", reason="set DCP_SAFE_LONG=1"),
]
# Kill points in flight at a time (one per core).
PARALLEL = 2
WRITERS = {
    "1thread": {"thread_count": 1},
    "2threads": {"thread_count": 2},
    "1thread-zstd": {"thread_count": 1, "compression": "zstd"},
    "2threads-zstd": {"thread_count": 2, "compression": "zstd"},
    "2threads-sha256": {"thread_count": 2, "checksum": "sha256"},
}


def _sweeps(default: dict[str, int]) -> list[Any]:
    """(writer options, stride): ``default`` writers with their stride (keep every stride-th
    bulk write) in the default run; every writer with every single operation in the long run."""
    return [
        pytest.param(WRITERS[w], stride, id=f"{w}-every-{stride}") for w, stride in default.items()
    ] + [
        pytest.param(options, 1, id=f"{w}-every-op", marks=[*LONG_ONLY, pytest.mark.timeout(3600)])
        for w, options in WRITERS.items()
        if w not in default or default[w] != 1
    ]


class CorruptPublish(AssertionError):
    """A listed checkpoint that does not verify, or loads as something never saved."""


class LastGoodLost(AssertionError):
    """The last good checkpoint is gone or changed, and nothing newer replaced it."""


@dataclass
class SweepReport:
    """What a sweep saw, kill point by kill point."""

    operations: int
    kill_points: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    corrupt_publishes: int = 0
    last_good_losses: int = 0
    other_failures: int = 0
    messages: list[str] = field(default_factory=list)

    def line(self, label: str) -> str:
        return (
            f"{label}: {self.operations} storage operations, {self.kill_points} kill points, "
            f"{dict(self.outcomes)}, corrupt publishes {self.corrupt_publishes}, "
            f"last-good losses {self.last_good_losses}"
        )

    def failed(self, where: str, exc: BaseException) -> None:
        if isinstance(exc, CorruptPublish):
            self.corrupt_publishes += 1
        elif isinstance(exc, LastGoodLost):
            self.last_good_losses += 1
        else:
            self.other_failures += 1
        self.messages.append(f"{where}: {type(exc).__name__}: {exc}")

    def finish(self, suite: str) -> None:
        """Record the figures, print them, and fail if any kill point failed its checks."""
        record_figures(
            "crash",
            suite=suite,
            kill_points=self.kill_points,
            corrupt_publishes=self.corrupt_publishes,
            last_good_losses=self.last_good_losses,
            other_failures=self.other_failures,
        )
        print(self.line(suite))
        assert not self.messages, "\n".join(self.messages[:5])


# Files the CheckpointManager keeps next to its checkpoints.
_NOT_CKPT = frozenset({HISTORY_FILE})


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding the last good checkpoint, ``step_1``, to copy for each kill point."""
    root = tmp_path_factory.mktemp("template")
    save_values(root, "step_1", 1)
    return root


def _check_root(
    root: Path,
    accept: dict[str, list[dict[str, Any]]],
    required: set[str],
    debris: frozenset[str] = frozenset(),
) -> str:
    """Check the root as a restarted job sees it; return which candidate each name held.

    ``accept`` maps each name that may be committed to the values it may hold (any one of them,
    bit for bit); names in ``required`` must be committed.
    """
    visible = sorted(e for e in os.listdir(root) if not e.startswith(".") and e not in _NOT_CKPT)
    listed = [info.name for info in dcp_safe.list_checkpoints(root)]
    leftovers = set(visible) - set(listed) - debris
    assert not leftovers, f"visible entries that are not checkpoints: {sorted(leftovers)}"
    if not required <= set(listed) or not listed:
        raise LastGoodLost(f"last good checkpoint lost: listed {listed}")
    assert set(listed) <= set(accept), f"unexpected checkpoints: {listed}"
    held = []
    for name in listed:
        try:
            dcp_safe.verify_checkpoint(root, name)
            loaded = load_values(root, name, accept[name][0])
        except dcp_safe.DcpSafeError as exc:
            raise CorruptPublish(f"{name} is listed but broken: {exc}") from exc
        matches = [i for i, values in enumerate(accept[name]) if is_bit_exact(loaded, values)]
        if not matches:
            error = LastGoodLost if name in required else CorruptPublish
            raise error(f"{name} loads, but as neither of the values saved under that name")
        held.append(f"{name}={matches[0]}")
    newest = listed[-1]
    latest = load_values(root, "latest", accept[newest][0])
    assert any(is_bit_exact(latest, values) for values in accept[newest]), "latest is not newest"
    return " ".join(held)


def _save(root: Path, name: str, seed: int, **writer_options: Any) -> None:
    save_values(root, name, seed, **writer_options)


def _next_save_succeeds(
    root: Path, name: str = "step_3", seed: int = 3, **writer_options: Any
) -> None:
    values = save_values(root, name, seed, **{**writer_options, "fsync": False})
    dcp_safe.verify_checkpoint(root, name)
    assert is_bit_exact(load_values(root, name, values), values)


def _probe(template: Path, work: Path, save: Callable[[Path], None]) -> list[str]:
    """Run the save once, unkilled, recording a label for each storage operation."""
    root, log = work / "probe", work / "probe.log"
    shutil.copytree(template, root)

    def child() -> None:
        switch = install_kill_switch(0, record=True)
        save(root)
        log.write_text("\n".join(switch.labels or []))

    assert fork_and_wait(child) == CHILD_DONE
    return log.read_text().splitlines()


def _kill_points(
    labels: list[str], stride: int, bulk_suffix: str = layout.SHARD_SUFFIX
) -> list[int]:
    """Every operation, except that of the many small writes torch.save makes into a shard
    (a file ending in ``bulk_suffix``) only every ``stride``-th and the last one are kept (they
    all leave the same kind of state: a shorter shard in a hidden directory)."""
    points, bulk_seen = [], 0
    for n, label in enumerate(labels, start=1):
        bulk = label.startswith(("write ", "write-rest ")) and label.endswith(bulk_suffix)
        following = labels[n] if n < len(labels) else ""
        last_of_run = bulk and following.partition(" ")[0] not in ("write", "write-rest")
        if not bulk or bulk_seen % stride == 0 or last_of_run:
            points.append(n)
        bulk_seen += bulk
    return points


def _sweep(
    template: Path,
    work: Path,
    save: Callable[[Path], None],
    check: Callable[[Path], str],
    next_saves: Callable[[Path], None],
    stride: int,
    how: str = "sigkill",
    thin: int = 1,
    bulk_suffix: str = layout.SHARD_SUFFIX,
) -> SweepReport:
    """Kill ``save`` before each chosen storage operation (``how``: SIGKILL or ``os._exit``;
    with ``thin``, only every thin-th of them), then ``check`` what it left and that
    ``next_saves`` succeed."""
    labels = _probe(template, work, save)
    report = SweepReport(operations=len(labels))
    chosen = _kill_points(labels, stride, bulk_suffix)
    # Thinning never drops a rename, unlink or rmdir: the publish and the retire steps are
    # the few operations where a kill has most to break.
    points = [
        n for i, n in enumerate(chosen) if i % thin == 0 or labels[n - 1].startswith(_KEEP_ALWAYS)
    ]
    points.append(len(labels) + 1)
    killed = -signal.SIGKILL if how == "sigkill" else CHILD_EXITED

    def start(kill_at: int) -> tuple[int, Path, int]:
        root = work / f"kill_{kill_at}"
        shutil.copytree(template, root, symlinks=True)

        def child() -> None:
            # The last point runs to completion with no kill at all: a manager's background
            # threads interleave, so its operation count varies by a few from the probe's.
            install_kill_switch(0 if kill_at > len(labels) else kill_at, how=how)
            save(root)

        return kill_at, root, start_fork(child)

    # PARALLEL children are always in flight, also while the parent checks the root a finished
    # one left: the checks (most of a kill point's time) run beside the next kills.
    pending = iter(points)
    in_flight = deque(start(kill_at) for kill_at in itertools.islice(pending, PARALLEL))
    status = None
    try:
        while in_flight:
            kill_at, root, pid = in_flight.popleft()
            status = wait_fork(pid)
            in_flight.extend(start(n) for n in itertools.islice(pending, 1))
            assert status in (CHILD_DONE, killed), f"child failed ({status}), see stderr"
            where = labels[kill_at - 1] if kill_at <= len(labels) else "none: ran to completion"
            report.kill_points += 1
            try:
                held = check(root)
                next_saves(root)
            except AssertionError as exc:
                report.failed(f"killed before op {kill_at} ({where})", exc)
                continue
            report.outcomes["completed" if status == CHILD_DONE else held] += 1
    finally:
        for _, _, pid in in_flight:  # a failed child ended the sweep: reap the others
            wait_fork(pid)
    assert status == CHILD_DONE, "a save given every operation did not complete"
    return report


_KEEP_ALWAYS = ("renameat2", "rename", "unlink", "rmdir")


def _plain_sweep(
    template: Path,
    work: Path,
    save: Callable[[Path], None],
    accept: dict[str, list[dict[str, Any]]],
    writer_options: dict[str, Any],
    stride: int,
    retry: tuple[str, int],
    how: str = "sigkill",
) -> SweepReport:
    """A sweep of one save: ``step_1`` must survive; then a new save succeeds, and the
    interrupted save, ``retry`` (name, seed), can be done again."""

    def next_saves(root: Path) -> None:
        _next_save_succeeds(root, **writer_options)
        committed = (root / retry[0] / layout.COMMITTED_MARKER).exists()
        if writer_options.get("overwrite") or not committed:
            _next_save_succeeds(root, *retry, **writer_options)

    return _sweep(
        template,
        work,
        save,
        lambda root: _check_root(root, accept, required={"step_1"}),
        next_saves,
        stride,
        how,
    )


@pytest.mark.parametrize(
    ("writer_options", "stride"), _sweeps({"1thread": 4, "2threads": 8, "2threads-zstd": 1})
)
def test_killed_save_never_publishes_a_broken_checkpoint_or_harms_the_last_good_one(
    template: Path, tmp_path: Path, writer_options: dict[str, Any], stride: int
) -> None:
    step_1, step_2 = make_values(1), make_values(2)
    report = _plain_sweep(
        template,
        tmp_path,
        lambda root: _save(root, "step_2", 2, **writer_options),
        accept={"step_1": [step_1], "step_2": [step_2]},
        writer_options=writer_options,
        stride=stride,
        retry=("step_2", 2),
    )
    report.finish(f"save {writer_options} stride {stride}")
    # The sweep crossed the publish: some kills left step_2 absent, some left it committed.
    assert report.outcomes["step_1=0"] > 0
    assert report.outcomes["step_1=0 step_2=0"] > 0  # killed after the rename, before the fsync
    assert report.kill_points >= 20


@pytest.mark.parametrize(("writer_options", "stride"), _sweeps({"1thread-zstd": 1}))
def test_save_ended_by_os_exit_never_publishes_a_broken_checkpoint(
    template: Path, tmp_path: Path, writer_options: dict[str, Any], stride: int
) -> None:
    step_1, step_2 = make_values(1), make_values(2)
    report = _plain_sweep(
        template,
        tmp_path,
        lambda root: _save(root, "step_2", 2, **writer_options),
        accept={"step_1": [step_1], "step_2": [step_2]},
        writer_options=writer_options,
        stride=stride,
        retry=("step_2", 2),
        how="exit",
    )
    report.finish(f"os._exit {writer_options} stride {stride}")
    assert report.outcomes["step_1=0"] > 0
    assert report.outcomes["step_1=0 step_2=0"] > 0


@pytest.mark.parametrize(("writer_options", "stride"), _sweeps({"2threads-zstd": 1}))
def test_killed_overwrite_leaves_the_old_or_the_new_checkpoint_whole(
    template: Path, tmp_path: Path, writer_options: dict[str, Any], stride: int
) -> None:
    old, new = make_values(1), make_values(2)
    options = {**writer_options, "overwrite": True}
    report = _plain_sweep(
        template,
        tmp_path,
        lambda root: _save(root, "step_1", 2, **options),
        accept={"step_1": [old, new]},
        writer_options=options,
        stride=stride,
        retry=("step_1", 2),
    )
    report.finish(f"overwrite {writer_options} stride {stride}")
    assert report.outcomes["step_1=0"] > 0  # killed before the exchange: the old one
    assert report.outcomes["step_1=1"] > 0  # killed after it (removing the old copy): the new one


# --------------------------------------------------------------------------- the manager

# (stride over bulk writes, then every thin-th kill point): ~37 kill points by default.
MANAGER_DEFAULT = {"1thread": (8, 3)}
LONG_MANAGER_SWEEPS = (
    ("1thread", "sigkill"),
    ("2threads-zstd", "sigkill"),
    ("2threads-sha256", "sigkill"),
    ("1thread", "exit"),
    ("2threads-zstd", "exit"),
)


def _manager(root: Path, remote: Path, **writer_options: Any) -> CheckpointManager:
    options = dcp_safe.WriterOptions(**writer_options)
    writer = dcp_safe.SafeStorageWriter(root, replicate_to=remote, options=options)
    return CheckpointManager(
        root,
        keep_last=1,
        policy=SavePolicy(name_format="step_{step}", sync_fallback=FallbackOptions(enabled=False)),
        retention=Retention(partial_grace_s=0.0),
        bounds=Bounds(exit_timeout_s=5.0),
        runtime=Runtime(writer=writer),
    )


def _manager_save(base: Path, *steps: int, **writer_options: Any) -> None:
    """Stage, save, verify, prune (keep_last=1) and replicate each step; wait for it all."""
    manager = _manager(base / "local", base / "remote", **writer_options)
    try:
        for step in steps:
            handle = manager.save(step, make_values(step))
            assert handle is not None
            handle.committed.result(timeout=120)
            handle.replicated.result(timeout=120)
    finally:
        manager.close(timeout_s=120)


@pytest.fixture(scope="module")
def manager_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``local`` and ``remote`` roots, each holding ``step_1`` and ``step_2`` saved (and
    validated) by a manager: retention keeps two validated checkpoints, so the save of
    ``step_3`` prunes ``step_1``."""
    base = tmp_path_factory.mktemp("manager_template")

    def child() -> None:
        _manager_save(base, 1, 2)

    assert fork_and_wait(child) == CHILD_DONE
    return base


def _check_tiers(base: Path) -> str:
    """Both tiers hold only whole checkpoints, and ``step_2``, the last good one, on each."""
    accept = {f"step_{i}": [make_values(i)] for i in (1, 2, 3)}
    tiers = ("local", "remote")
    return " | ".join(
        _check_root(base / tier, accept, required={"step_2"}, debris=_PRUNE_DEBRIS)
        for tier in tiers
    )


def _manager_saves_again(base: Path, **writer_options: Any) -> None:
    """A restarted job's manager saves step_4 on both tiers."""
    _manager_save(base, 4, **{**writer_options, "fsync": False})
    for tier in ("local", "remote"):
        dcp_safe.verify_checkpoint(base / tier, "step_4")


# Pruning unpublishes first (the commit strategy's retire): a prune killed half-way leaves only a
# hidden partial directory, never the rest of step_1 under its own name.
_PRUNE_DEBRIS: frozenset[str] = frozenset()


def _manager_sweeps() -> list[Any]:
    long = [*LONG_ONLY, pytest.mark.timeout(3600)]
    return [
        pytest.param(w, stride, thin, "sigkill", id=f"{w}-every-{stride}-thin-{thin}")
        for w, (stride, thin) in MANAGER_DEFAULT.items()
    ] + [
        pytest.param(w, 1, 1, how, id=f"{w}-every-op-{how}", marks=long)
        for w, how in LONG_MANAGER_SWEEPS
    ]


@pytest.mark.parametrize(("writer", "stride", "thin", "how"), _manager_sweeps())
def test_killed_manager_save_with_pruning_and_replication_keeps_a_whole_checkpoint(
    manager_template: Path, tmp_path: Path, writer: str, stride: int, thin: int, how: str
) -> None:
    options = WRITERS[writer]
    report = _sweep(
        manager_template,
        tmp_path,
        lambda base: _manager_save(base, 3, **options),
        _check_tiers,
        lambda base: _manager_saves_again(base, **options),
        stride,
        how=how,
        thin=thin,
    )
    report.finish(f"manager {writer} stride {stride} thin {thin} {how}")
    local = Counter(outcome.partition(" | ")[0] for outcome in report.outcomes.elements())
    # Kills landed before step_3 was committed, after it, and after step_1 was pruned.
    assert local["step_1=0 step_2=0"] > 0
    assert local["step_1=0 step_2=0 step_3=0"] > 0
    assert local["step_2=0 step_3=0"] > 0


def test_overwrite_without_renameat2_is_refused_and_keeps_the_old_checkpoint(
    template: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(template, root)

    def child() -> None:
        # A file system without renameat2 (EINVAL): replacing would take two renames.
        local_backend._renameat2 = lambda *args: False  # type: ignore[assignment]
        try:
            save_values(root, "step_1", 2, overwrite=True)
        except dcp_safe.StorageError:
            os._exit(3)

    assert fork_and_wait(child) == 3
    assert not [e for e in os.listdir(root) if e.startswith(".")]  # the partial was discarded
    old = make_values(1)
    assert is_bit_exact(load_values(root, "step_1", old), old)


# --------------------------------------------------------------------------- torch_checkpointing


def _tc_manager(root: Path, save: str = "sync", **options: Any) -> Any:
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.default_resharder import DefaultResharder

    from dcp_safe.torch_checkpointing import manager_config

    items = {"model": ItemSpec(resharder=DefaultResharder())}
    return CheckpointManager(manager_config(root, save=save, items=items, **options))


def _tc_save(root: Path, name: str, seed: int) -> None:
    mgr = _tc_manager(root)
    try:
        mgr.save(name, {"model": make_values(seed), "step": seed})
    finally:
        mgr.close()


def _tc_load(root: Path, name: str) -> dict[str, Any]:
    mgr = _tc_manager(root)
    try:
        into = {"model": blank_like(make_values(0)), "step": None}
        return dict(mgr.load(name, into=into))
    finally:
        mgr.close()


def _check_tc_root(root: Path) -> str:
    """As a restarted job sees it: ``step_1`` whole, ``step_2`` absent or whole, ``latest`` the
    newest, nothing else visible; what is listed verifies byte for byte and loads as saved."""
    visible = sorted(e for e in os.listdir(root) if not e.startswith("."))
    listed = [info.name for info in dcp_safe.list_checkpoints(root)]
    assert set(visible) == set(listed), f"visible entries that are not checkpoints: {visible}"
    if "step_1" not in listed:
        raise LastGoodLost(f"last good checkpoint lost: listed {listed}")
    assert set(listed) <= {"step_1", "step_2"}, f"unexpected checkpoints: {listed}"
    for name in listed:
        try:
            dcp_safe.verify_checkpoint(root, name, deep=True)
            loaded = _tc_load(root, name)
        except dcp_safe.DcpSafeError as exc:
            raise CorruptPublish(f"{name} is listed but broken: {exc}") from exc
        seed = int(name[5:])
        if loaded["step"] != seed or not is_bit_exact(loaded["model"], make_values(seed)):
            error = LastGoodLost if name == "step_1" else CorruptPublish
            raise error(f"{name} loads, but not as the values saved under that name")
    latest = dcp_safe.list_checkpoints(root)[-1].name
    assert latest == listed[-1], "latest is not newest"
    return " ".join(f"{name}=0" for name in listed)


def _tc_saves_again(root: Path) -> None:
    """The restarted job saves (``step_2`` again if the killed save never published)."""
    names = ["step_3"] if (root / "step_2").exists() else ["step_2", "step_3"]
    for name in names:
        _tc_save(root, name, int(name[5:]))
        dcp_safe.verify_checkpoint(root, name, deep=True)
        assert is_bit_exact(_tc_load(root, name)["model"], make_values(int(name[5:])))


@pytest.mark.parametrize(
    "stride", [8, pytest.param(1, marks=[*LONG_ONLY, pytest.mark.timeout(3600)], id="every-op")]
)
def test_killed_torch_checkpointing_save_never_publishes_a_broken_checkpoint(
    tmp_path: Path, stride: int
) -> None:
    """torch_checkpointing's sync saver on a dcp_safe root (issue 45), killed before each of its
    storage operations: the same guarantees as a DCP save."""
    pytest.importorskip("torch_checkpointing")
    template = tmp_path / "template"
    template.mkdir()
    assert fork_and_wait(lambda: _tc_save(template, "step_1", 1)) == CHILD_DONE
    report = _sweep(
        template,
        tmp_path / "work",
        lambda root: _tc_save(root, "step_2", 2),
        _check_tc_root,
        _tc_saves_again,
        stride=stride,
        bulk_suffix=".pt",  # torch_checkpointing's files: torch.save's many small writes
    )
    report.finish("torch_checkpointing sync save")
    assert report.outcomes["step_1=0"] > 0  # killed before the marker: step_2 never listed
    assert report.outcomes["step_1=0 step_2=0"] > 0  # killed after it: step_2 whole
    assert report.kill_points >= 20


def _saver_init(kill_at: int) -> None:
    """torch_checkpointing's ``subprocess_init_fn``: its saver process is SIGKILLed just before
    its ``kill_at``-th storage operation."""
    install_kill_switch(kill_at)


def _tc_async_save_killed(root: Path, kill_at: int) -> None:
    mgr = _tc_manager(
        root, "async", subprocess_init_fn=_saver_init, subprocess_init_args=(kill_at,)
    )
    try:
        future = mgr.save("step_2", {"model": make_values(2), "step": 2})
        assert future is not None
        with pytest.raises(RuntimeError, match="terminated"):
            future.result(timeout=120)  # the training process learns that its saver died
    finally:
        with contextlib.suppress(RuntimeError):  # the same news, again, from the dead saver
            mgr.close()


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "every", [None, pytest.param(4, marks=[*LONG_ONLY, pytest.mark.timeout(3600)], id="every-4")]
)
def test_killed_torch_checkpointing_saver_process_leaves_the_last_checkpoint_whole(
    tmp_path: Path, every: int | None
) -> None:
    """The async saver's own process (spawned by torch_checkpointing, where the writes and the
    commit run) killed mid-save and just after the publish; by default those two kill points
    (a process start each), in long mode every 4th operation too."""
    pytest.importorskip("torch_checkpointing")
    template = tmp_path / "template"
    template.mkdir()
    assert fork_and_wait(lambda: _tc_save(template, "step_1", 1)) == CHILD_DONE
    # The saver process runs the same writer as the sync saver: its operations, counted here.
    labels = _probe(template, tmp_path, lambda root: _tc_save(root, "step_2", 2))
    publish = next(n for n, label in enumerate(labels, 1) if label.startswith("renameat2"))
    mid_data = next(n for n, label in enumerate(labels, 1) if label.startswith("write "))
    points = [mid_data + 8, publish + 1]
    if every is not None:
        points = sorted({*points, publish, *range(1, len(labels) + 1, every)})
    seen: Counter[str] = Counter()
    for kill_at in points:
        root = tmp_path / f"kill_{kill_at}"
        shutil.copytree(template, root)
        _tc_async_save_killed(root, kill_at)
        seen[_check_tc_root(root)] += 1
        _tc_saves_again(root)
    assert seen["step_1=0"] > 0 and seen["step_1=0 step_2=0"] > 0, seen


# --------------------------------------------------------------------------- fresh processes


def _kill_save_loop(child: BaseProcess, conn: Connection, delay_s: float) -> None:
    """Let the child start its save loop, then SIGKILL it ``delay_s`` later."""
    try:
        assert conn.poll(120) and conn.recv() == "ready"
        conn.send("go")
        assert conn.poll(120) and conn.recv() == "saving"
        select.select([], [], [], delay_s)  # a sleep; nothing is measured
    finally:
        child.kill()
        child.join(60)
    assert child.exitcode == -signal.SIGKILL, "the save loop ended by itself"


@pytest.mark.parametrize(
    "kills", [10, pytest.param(100, marks=[*LONG_ONLY, pytest.mark.timeout(3600)])]
)
def test_process_killed_at_a_random_moment_leaves_only_whole_checkpoints(
    tmp_path: Path, kills: int
) -> None:
    """Processes of their own, forked from the fork server that starts ``run_ranks``' ranks
    (torch imported once, nothing else run there), each killed at a random moment of a save
    loop (:func:`_crash.save_loop`)."""
    scale = 20  # ~50 KB per checkpoint: a save takes long enough to be hit in the middle
    template = tmp_path / "template"
    save_values(template, "step_1", 1, scale=scale)
    rng = random.Random(20240601)
    ctx = rank_context()
    killed_mid_save = 0
    for wave in range(0, kills, 5):
        # Five processes at once; each starts saving only when told to.
        roots = [tmp_path / f"run_{i}" for i in range(wave, min(wave + 5, kills))]
        children: list[tuple[BaseProcess, Connection]] = []
        try:
            for root in roots:
                shutil.copytree(template, root)
                ours, theirs = ctx.Pipe()
                child = ctx.Process(target=save_loop, args=(str(root), scale, theirs), daemon=True)
                child.start()
                theirs.close()
                children.append((child, ours))
            for root, (child, conn) in zip(roots, children, strict=True):
                delay_s = rng.uniform(0.0, 0.3)
                _kill_save_loop(child, conn, delay_s)
                killed_mid_save += any(layout.is_partial_entry(e) for e in os.listdir(root))
                names = [e for e in os.listdir(root) if not e.startswith(".")]
                accept = {name: [make_values(int(name[5:]), scale=scale)] for name in names}
                try:
                    _check_root(root, accept, required={"step_1"})
                    _next_save_succeeds(root, "after_the_crash")
                except Exception as exc:
                    where = f"{root.name}, killed {delay_s * 1000:.0f} ms into its save loop"
                    raise AssertionError(f"{where}: {exc}") from exc
        finally:
            for child, _ in children:
                if child.is_alive():
                    child.kill()
                    child.join(60)
    record_figures("fresh", kills=kills, killed_mid_save=killed_mid_save)
    print(f"fresh-process kills: {kills}, killed mid-save (partial left behind): {killed_mid_save}")


# --------------------------------------------------------------------------- durability order


def _linked_as(path: str) -> str:
    """The name a file written aside under ``path`` (a temporary name) is linked in as."""
    folder, leaf = os.path.split(path)
    if leaf.startswith(".") and layout.TEMP_INFIX in leaf:
        return os.path.join(folder, leaf[1 : leaf.index(layout.TEMP_INFIX)])
    return path


def test_everything_published_was_fsynced_before_the_rename(tmp_path: Path) -> None:
    """A power cut loses unsynced data, which SIGKILL does not; so check the order directly:
    every file and directory of the checkpoint is fsynced before the publishing rename, each
    directory after the files in it, and the root directory after the rename."""
    log = tmp_path / ".events"

    def child() -> None:
        events: list[str] = []
        real_fsync, real_renameat2 = os.fsync, local_backend._renameat2

        def fsync(fd: int) -> None:
            real_fsync(fd)
            events.append(f"fsync\t{os.readlink(f'/proc/self/fd/{fd}')}")

        def renameat2(src_dir: int, src: str, dst_dir: int, dst: str, flags: int) -> bool:
            done = real_renameat2(src_dir, src, dst_dir, dst, flags)
            events.append(f"rename\t{os.path.join(os.readlink(f'/proc/self/fd/{dst_dir}'), dst)}")
            return done

        os.fsync = fsync  # type: ignore[assignment]
        local_backend._renameat2 = renameat2  # type: ignore[assignment]
        save_values(tmp_path, "step_1", 1, thread_count=2)
        log.write_text("\n".join(events))  # the parent does not share this process's memory

    assert fork_and_wait(child) == CHILD_DONE
    # A small file (a marker, a manifest) is written and fsynced aside, then linked in whole as
    # its name (LocalBackend.write_bytes): its fsync is that name's.
    events = [
        (kind, _linked_as(path) if kind == "fsync" else path)
        for kind, path in (tuple(line.split("\t")) for line in log.read_text().splitlines())
    ]
    root = os.path.realpath(tmp_path)
    published = os.path.join(root, "step_1")
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert [events[i][1] for i in renames] == [published]
    # The work directory is the one whose fsync'd paths sit where step_1's files are now.
    synced = [path for kind, path in events[: renames[0]] if kind == "fsync"]
    work_dirs = {os.path.dirname(p) for p in synced if p.endswith(layout.COMMITTED_MARKER)}
    assert len(work_dirs) == 1, "the commit marker was not fsynced before the rename"
    work = work_dirs.pop()
    last_sync = {path: i for i, path in enumerate(synced)}
    for dirpath, dirnames, filenames in os.walk(published):
        before = os.path.normpath(os.path.join(work, os.path.relpath(dirpath, published)))
        where = os.path.relpath(dirpath, root)
        assert before in last_sync, f"{where} was not fsynced before the publishing rename"
        for entry in dirnames + filenames:
            entry_before = os.path.join(before, entry)
            assert entry_before in last_sync, f"{where}/{entry} not fsynced before the rename"
            assert last_sync[entry_before] < last_sync[before], f"{where} fsynced before {entry}"
    synced_after = [path for kind, path in events[renames[0] :] if kind == "fsync"]
    assert root in synced_after, "the root was not fsynced after the rename"
