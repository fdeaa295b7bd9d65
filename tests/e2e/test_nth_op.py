"""Fail storage operation N of a save, for every N: it fails cleanly or it succeeds, never worse.

``step_1`` is committed; then for N = 1, 2, ... a save of ``step_2`` runs on a
:class:`~dcp_safe.testing.faulty_fs.FaultyFileSystem` root whose N-th operation fails (``EIO``;
torn where it is a write), once ("one-off") or from then on ("persistent"), until N passes the
save's last operation. Every case must end one of two ways:

* the save raised a dcp_safe error (a :class:`~dcp_safe.errors.DcpSafeError`) and nothing was
  published: ``step_2`` is not listed, ``step_1`` verifies and loads bit for bit, a next save
  (``step_3``) commits, and ``step_2`` can be saved again (at once after a one-off fault; after
  the sweeper collects what a persistent fault kept the writer from cleaning up, otherwise);
* or the save returned and ``step_2`` verifies and loads bit for bit.

Local roots sweep every N in the default run; S3 (moto) sweeps a sample of N by default and
every N with ``DCP_SAFE_LONG=1``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _crash import (
    is_bit_exact,
    make_values,
    record_figures,
)

import dcp_safe
from dcp_safe import DcpSafeError, SafeStorageReader, SafeStorageWriter, WriterOptions
from dcp_safe.commit import lease as lease_module
from dcp_safe.errors import CheckpointExistsError
from dcp_safe.layout import WRITING_LEASE
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def _short_lease_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease a failed save left behind is judged over two rounds with a random pause between
    them (0.05-0.5 s, so that two racing contenders part). A sweep saves one save at a time:
    no contender rewrites a lease during the pause, and a pause of milliseconds judges the same
    lease the same way. Those pauses were 11 of the persistent local sweep's 17 s."""
    monkeypatch.setattr(lease_module, "_PAUSE_S", (0.001, 0.005))


LONG = os.environ.get("DCP_SAFE_LONG") == "1"
TESTS_DIR = Path(__file__).resolve().parents[1]
# Of the S3 sweep's N, the default run tries this many, spread over the whole save.
S3_SAMPLE = 4


def values(seed: int) -> dict[str, Any]:
    """Two dtypes and a Python object: every kind of item, few storage operations (each
    tensor is ~40 writes), so that the full sweep stays cheap."""
    full = make_values(seed)
    return {"w": full["w"][:4], "bf16": full["bf16"], "extra": full["extra"]}


@dataclass
class NthOpReport:
    """What a sweep saw, case by case."""

    operations: int = 0
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failed_kinds: Counter[str] = field(default_factory=Counter)
    broken_publishes: int = 0
    last_good_lost: int = 0

    def line(self, label: str) -> str:
        return (
            f"{label}: {self.operations} operations per save, {self.cases} cases, "
            f"{dict(self.outcomes)}, failed op kinds {dict(self.failed_kinds)}"
        )


@dataclass
class FaultyRoot:
    """A root behind a fault injector, and how to make a fresh one holding ``step_1``."""

    url: str
    options: dict[str, Any]
    faults: FaultInjector
    template: Path | None = None  # a local copy of a root holding step_1, if there is one
    path: Path | None = None

    def seed_last_good(self) -> None:
        """Commit ``step_1`` (a copy of the template on a local root: much cheaper)."""
        if self.template is not None and self.path is not None:
            shutil.copytree(self.template, self.path, dirs_exist_ok=True)
            return
        self.faults.reset(FaultPlan())
        self.save("step_1", values(1))

    def save(self, name: str, values: dict[str, Any]) -> None:
        writer = SafeStorageWriter(
            self.url, storage_options=self.options, options=WriterOptions(thread_count=1)
        )
        dcp_safe.save(values, checkpoint_id=name, storage_writer=writer, no_dist=True)

    def load(self, name: str, like: dict[str, Any]) -> dict[str, Any]:
        from _crash import blank_like

        target = blank_like(like)
        reader = SafeStorageReader(self.url, storage_options=self.options)
        dcp_safe.load(target, checkpoint_id=name, storage_reader=reader, no_dist=True)
        return target

    def listed(self) -> list[str]:
        return [c.name for c in dcp_safe.list_checkpoints(self.url, storage_options=self.options)]


def _local_root(base: Path, faults: FaultInjector) -> Callable[[int], FaultyRoot]:
    template = base / "template"

    def fresh(case: int) -> FaultyRoot:
        path = base / f"case_{case}"
        path.mkdir()
        options = {"target_protocol": "file", "faults": faults}
        if case == 0:  # the probe: its step_1 becomes the template
            return FaultyRoot(f"faulty://{path}", options, faults, path=path)
        if not template.exists():
            shutil.copytree(base / "case_0", template, ignore=shutil.ignore_patterns("step_2"))
        return FaultyRoot(f"faulty://{path}", options, faults, template, path)

    return fresh


def _s3_root(
    bucket: str, target_options: dict[str, Any], faults: FaultInjector
) -> Callable[[int], FaultyRoot]:
    def fresh(case: int) -> FaultyRoot:
        options = {"target_protocol": "s3", "target_options": target_options, "faults": faults}
        return FaultyRoot(f"faulty://{bucket}/case_{case}", options, faults)

    return fresh


def _check_case(root: FaultyRoot, error: BaseException | None, one_off: bool) -> str:
    """Check one case with the faults paused; return its outcome."""
    step_1, step_2 = values(1), values(2)
    listed = root.listed()
    assert "step_1" in listed, f"last good checkpoint lost: listed {listed}"
    dcp_safe.verify_checkpoint(root.url, "step_1", storage_options=root.options)
    assert is_bit_exact(root.load("step_1", step_1), step_1), "step_1 changed"
    if error is not None:
        assert isinstance(error, DcpSafeError), f"untyped error {type(error).__name__}: {error}"
    if "step_2" in listed or error is None:
        assert listed == ["step_1", "step_2"], f"save returned but listed {listed}"
        dcp_safe.verify_checkpoint(root.url, "step_2", storage_options=root.options)
        assert is_bit_exact(root.load("step_2", step_2), step_2), "step_2 is not what was saved"
        if error is None:
            return _next_save(root, "succeeded")
        # The marker was written, then a clean-up step (removing the lease) failed: the
        # checkpoint is whole, but the caller was told the save failed. Counted and reported.
        assert WRITING_LEASE in root.faults.failures[0].path, error
        return _next_save(root, f"failed-after-commit:{type(error).__name__}")
    assert listed == ["step_1"], f"a failed save published something: {listed}"
    return _next_save(root, f"failed:{type(error).__name__}") + _save_again(root, step_2, one_off)


def _next_save(root: FaultyRoot, outcome: str) -> str:
    root.save("step_3", values(3))
    assert "step_3" in root.listed(), "the next save did not commit"
    return outcome


def _save_again(root: FaultyRoot, step_2: dict[str, Any], one_off: bool) -> str:
    """The failed name can be saved again: at once, or after the sweeper (a persistent fault
    also failed the clean-up, and the save's lease stays until its grace period ends)."""
    try:
        root.save("step_2", step_2)
        how = ""
    except CheckpointExistsError:
        # Expected after a persistent fault (the clean-up failed too). After a one-off fault
        # it is a writer that took the lease and failed before it could use it (counted).
        dcp_safe.sweep_partials(root.url, grace_s=0, storage_options=root.options)
        root.save("step_2", step_2)
        how = "+swept" if not one_off else "+blocked-until-swept"
    dcp_safe.verify_checkpoint(root.url, "step_2", storage_options=root.options)
    return how


def nth_op_sweep(
    fresh_root: Callable[[int], FaultyRoot],
    *,
    persistent: bool,
    sample: int | None = None,
) -> NthOpReport:
    """Fail operation N of a save of ``step_2`` for N = 1, 2, ... (or ``sample`` of them)."""
    probe = fresh_root(0)
    faults = probe.faults
    faults.reset(FaultPlan())
    probe.save("step_1", values(1))
    faults.reset(FaultPlan())
    probe.save("step_2", values(2))
    report = NthOpReport(operations=faults.calls)
    points = list(range(1, report.operations + 2))
    if sample is not None and sample < len(points):
        stride = len(points) / sample
        points = sorted({points[int(i * stride)] for i in range(sample)} | {points[-1]})
    for n in points:
        root = fresh_root(n)
        faults.reset(FaultPlan())
        root.seed_last_good()
        faults.reset(FaultPlan(fail_at=n, persistent=persistent))
        error: BaseException | None = None
        try:
            root.save("step_2", values(2))
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
        report.failed_kinds.update(r.kind for r in faults.failures[:1])
        faults.pause()
        try:
            outcome = _check_case(root, error, one_off=not persistent)
        except AssertionError as exc:
            where = faults.failures[0] if faults.failures else "no fault reached"
            raise AssertionError(f"fail at op {n} ({where}), error {error!r}: {exc}") from exc
        finally:
            faults.resume()
        report.cases += 1
        report.outcomes[outcome] += 1
    assert report.outcomes["succeeded"] >= 1, "the sweep never got past the save's last op"
    return report


def _record(report: NthOpReport, root: str, persistent: bool) -> None:
    outcomes = report.outcomes
    record_figures(
        "nth_op",
        root=root,
        mode="persistent" if persistent else "one-off",
        operations=report.operations,
        cases=report.cases,
        failed_cleanly=sum(n for o, n in outcomes.items() if o.startswith("failed:")),
        failed_after_commit=sum(n for o, n in outcomes.items() if o.startswith("failed-after")),
        blocked_until_swept=sum(n for o, n in outcomes.items() if "blocked" in o),
        succeeded=outcomes["succeeded"],
        broken_publishes=0,  # a broken publish fails the sweep before it gets here
    )


_ABORT_PROBE = """
import gc, sys
sys.path.insert(0, sys.argv[1])
from _crash import make_values
import dcp_safe
from dcp_safe.testing.faulty_fs import FaultInjector, FaultPlan
faults = FaultInjector(FaultPlan(fail_at=3, ops=("write",)))
writer = dcp_safe.SafeStorageWriter(
    "faulty://" + sys.argv[2], storage_options={"target_protocol": "file", "faults": faults}
)
try:
    dcp_safe.save(make_values(1), checkpoint_id="step_1", storage_writer=writer, no_dist=True)
except dcp_safe.StorageError:
    print("failed", flush=True)
gc.collect()
print("alive")
"""


def test_a_failed_shard_write_does_not_abort_the_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ABORT_PROBE, str(TESTS_DIR), str(tmp_path)],
        capture_output=True,
        timeout=300,
        check=False,
    )
    # The save failed mid-tensor (the third write), and the process outlived the collection
    # of torch's unfinished zip writer.
    assert done.stdout.split() == [b"failed", b"alive"], done.stderr[-2000:]
    assert done.returncode == 0


@pytest.mark.parametrize("persistent", [False, True], ids=["one-off", "persistent"])
def test_failing_any_operation_of_a_local_save_fails_cleanly_or_commits(
    tmp_path: Path, persistent: bool
) -> None:
    faults = FaultInjector()
    report = nth_op_sweep(_local_root(tmp_path, faults), persistent=persistent)
    print(report.line(f"local {'persistent' if persistent else 'one-off'}"))
    _record(report, "local", persistent)
    assert report.cases == report.operations + 1  # every N, and one past the end
    assert sum(n for o, n in report.outcomes.items() if o.startswith("failed")) > 0
    # The faults hit every kind of operation the save makes, not just one.
    assert {"open", "write", "close", "mkdir", "move", "info"} <= set(report.failed_kinds)


@pytest.mark.s3
@pytest.mark.parametrize("persistent", [False, True], ids=["one-off", "persistent"])
def test_failing_any_operation_of_an_s3_save_fails_cleanly_or_commits(
    s3_bucket: str,
    s3_options: dict[str, Any],
    persistent: bool,
) -> None:
    faults = FaultInjector()
    report = nth_op_sweep(
        _s3_root(s3_bucket, s3_options, faults),
        persistent=persistent,
        sample=None if LONG else S3_SAMPLE,
    )
    print(report.line(f"s3 {'persistent' if persistent else 'one-off'}"))
    _record(report, "s3", persistent)
    assert sum(n for o, n in report.outcomes.items() if o.startswith("failed")) > 0
