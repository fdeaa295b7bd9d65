"""Run every entry point of dcp_safe against hostile roots; write one JSON report per root.

Used by ``test_hostile_corpus.py``. This process imports torch and dcp_safe once, then forks one
child per case, so a hang, a crash or a memory blow-up in one case cannot take the others with
it, and the imports (seconds) are paid once, not once per case. Each entry point runs under its
own alarm, so a hang is recorded as ``hang`` and the next entry point still runs; a child that
does not finish within ``case_timeout_s`` is killed. The CLI is called in-process through
``dcp_safe.cli.main`` with its output captured, so a traceback (any exception escaping
``main``) is seen as one.

The child reports its peak RSS with its cells: what every entry point together cost, torch
and dcp_safe themselves included (they are loaded before the fork).

``python _hostile_driver.py --check-saves SPEC_JSON_FILE`` is the other mode: a fresh process
that saves the "save" entry point's state itself, then checks that each case's own save (made
after every hostile entry point had run in that case's process) is byte for byte the same (but
for each item's per-save serialization id) and loads exactly: a refused hostile load left
nothing behind in the process that refused it.

Usage: ``python _hostile_driver.py SPECS_JSON_FILE``: a list of specs, each naming ``root``,
``remote`` (or null), ``good`` and ``bad`` (checkpoint names), ``good_seed``, ``latest`` (the
name and seed a load of ``"latest"`` must give when it loads at all), ``timeout_s`` per entry
point, ``case_timeout_s``, ``report`` (where to write the case's JSON report) and ``writes``
(also run the entry points that write, last: a fenced save, and a manager's save, prune and
restore). Several drivers may share one list: each runs the cases it claims first (an
exclusive create of ``report`` + ``.claimed``), so none waits while another still has cases.

Cells of the report: ``ok``, ``ok: <detail>``, ``refused: <ErrorType>`` (a dcp_safe error),
``exit <n>: <last line on stderr>`` (CLI), or a failure: ``error: <Type>: <message>``,
``hang``, ``wrong: <detail>`` (a control character in the CLI's output is one),
``traceback: ...``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed.checkpoint as dcp
from support import blank_like, differing_tensors, make_state
from torch.distributed.checkpoint.api import CheckpointException

import dcp_safe
from dcp_safe import (
    CheckpointManager,
    Resume,
    SafeStorageReader,
    SafeStorageWriter,
    Topology,
    WriterOptions,
)
from dcp_safe.checkpoints.catalog import list_checkpoints, verify_checkpoint
from dcp_safe.cli import main as cli_main
from dcp_safe.errors import DcpSafeError, from_checkpoint_exception

warnings.simplefilter("ignore")


# What a terminal acts on (C0 controls but tab and newline, DEL, C1, separators, bidi): text
# from storage must never reach the CLI's output with one of these in it.
_ACTIVE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# The checkpoint the "save" entry point writes (the manager's is step_000000006).
SAVED = "step_000000005"


class _Hang(BaseException):
    """Raised by the alarm: the entry point did not return in time."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang


def _cell(run: Callable[[], str], timeout_s: int) -> str:
    """Run one entry point: its own cell text, or the failure it showed."""
    signal.alarm(timeout_s)
    try:
        return run()
    except _Hang:
        return "hang"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        # Plain dcp.load lets DCP's CheckpointException (a BaseException) out: what it carries
        # is what counts.
        error = from_checkpoint_exception(exc) if isinstance(exc, CheckpointException) else exc
        if isinstance(error, DcpSafeError):
            return f"refused: {type(error).__name__}"
        return f"error: {type(error).__name__}: {str(error)[:200]}"
    finally:
        signal.alarm(0)


def _same(actual: dict[str, Any], seed: int) -> bool:
    expected = make_state(seed)
    return not differing_tensors(actual, expected) and actual["extra"] == expected["extra"]


class Driver:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.root: str = spec["root"]
        self.remote: str | None = spec["remote"]
        self.latest_name, self.latest_seed = spec["latest"]

    # ------------------------------------------------------------------ library entry points

    def _check_loaded(self, target: dict[str, Any], name: str | None, *, seed: int) -> str:
        if not _same(target, seed):
            return f"wrong: {name} did not load the values saved (seed {seed})"
        return f"ok: {name}"

    def _latest_then_good(
        self, load: Callable[[dict[str, Any], str], str | None]
    ) -> tuple[str, bool]:
        """Load ``latest`` (the cell) and the good checkpoint by name (must be exact)."""

        def latest() -> str:
            target = blank_like(make_state(self.latest_seed))
            name = load(target, "latest")
            if name is not None and name != self.latest_name:
                return f"wrong: latest is {name}, expected {self.latest_name}"
            return self._check_loaded(target, name, seed=self.latest_seed)

        def good() -> str:
            target = blank_like(make_state(self.spec["good_seed"]))
            load(target, self.spec["good"])
            return self._check_loaded(target, self.spec["good"], seed=self.spec["good_seed"])

        timeout_s = self.spec["timeout_s"]
        return _cell(latest, timeout_s), _cell(good, timeout_s) == f"ok: {self.spec['good']}"

    def _reader(self, checkpoint_id: str) -> SafeStorageReader:
        return SafeStorageReader(self.root, fallback=self.remote, checkpoint_id=checkpoint_id)

    def dcp_load(self, target: dict[str, Any], checkpoint_id: str) -> str | None:
        reader = self._reader(checkpoint_id)
        dcp.load(target, checkpoint_id=checkpoint_id, storage_reader=reader, no_dist=True)
        return reader.checkpoint_id

    def dcp_safe_load(self, target: dict[str, Any], checkpoint_id: str) -> str | None:
        reader = self._reader(checkpoint_id)
        dcp_safe.load(target, checkpoint_id=checkpoint_id, storage_reader=reader, no_dist=True)
        return reader.checkpoint_id

    def restore(self, target: dict[str, Any], checkpoint_id: str) -> str | None:
        step: int | str = checkpoint_id
        if checkpoint_id != "latest":
            step = int(checkpoint_id.rsplit("_", 1)[1])
        topology = Topology.of(self.root, replicate_to=self.remote)
        manager = CheckpointManager(topology, keep_last=100)
        try:
            return manager.restore(target, step)
        finally:
            manager.close()

    def list(self) -> tuple[str, bool]:
        names: list[str] = []

        def run() -> str:
            names.extend(info.name for info in list_checkpoints(self.root))
            shown = "listed" if self.spec["bad"] in names else "not listed"
            return f"ok: bad {shown}"

        cell = _cell(run, self.spec["timeout_s"])
        return cell, self.spec["good"] in names

    def verify(self) -> tuple[str, bool]:
        bad = _cell(lambda: _ok(verify_checkpoint(self.root, self.spec["bad"])), 60)
        good = _cell(lambda: _ok(verify_checkpoint(self.root, self.spec["good"])), 60)
        return bad, good == "ok"

    # ------------------------------------------------------------------ the CLI

    def cli(self, *argv: str) -> tuple[str, bool]:
        """``dcp-safe argv``: the cell is its exit status and its last line."""
        out, err = io.StringIO(), io.StringIO()
        result: dict[str, Any] = {}

        def run() -> str:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    result["status"] = cli_main(list(argv))
                except BaseException:
                    result["traceback"] = traceback.format_exc()
            return "done"

        cell = _cell(run, self.spec["timeout_s"])
        if cell != "done":
            return cell, False
        if "traceback" in result:
            return "traceback: " + result["traceback"].strip().splitlines()[-1], False
        status, errors = result["status"], err.getvalue().strip().splitlines()
        if "Traceback" in out.getvalue() + err.getvalue():
            return f"traceback in output (exit {status})", False
        if _ACTIVE.search(out.getvalue() + err.getvalue()):
            return f"wrong: a control character in the output (exit {status})", False
        if status != 0 and len(errors) != 1:
            return f"exit {status} with {len(errors)} lines on stderr", False
        summary = errors[-1][:160] if errors else "-"
        return f"exit {status}: {summary}", self.spec["good"] in out.getvalue()

    def report(self) -> dict[str, Any]:
        root, bad, good = self.root, self.spec["bad"], self.spec["good"]
        cells: dict[str, tuple[str, bool]] = {}
        cells["dcp.load"] = self._latest_then_good(self.dcp_load)
        cells["dcp_safe.load"] = self._latest_then_good(self.dcp_safe_load)
        cells["restore"] = self._latest_then_good(self.restore)
        cells["list_checkpoints"] = self.list()
        cells["verify_checkpoint"] = self.verify()
        ls = ["ls", root, "--json"] + (["--remote", self.remote] if self.remote else [])
        cells["cli ls"] = self.cli(*ls)
        cells["cli verify"] = (self.cli("verify", root, bad)[0], self.cli("verify", root, good)[1])
        cells["cli inspect"] = (
            self.cli("inspect", root, bad)[0],
            self.cli("inspect", root, good, "--json")[1],
        )
        gc = self.cli("gc", root, "--keep", "100")
        cells["cli gc"] = (gc[0], not gc[0].startswith(("hang", "traceback", "error")))
        if self.spec.get("writes"):  # last: they add checkpoints the cells above do not expect
            cells["save"] = (_cell(self.save, self.spec["timeout_s"]), True)
            cells["manager"] = self.manager()
        return {name: {"cell": cell, "good_ok": ok} for name, (cell, ok) in cells.items()}

    # ------------------------------------------------------------------ writers

    def save(self) -> str:
        """A new checkpoint, fenced (attempt 1 registers under ``_ATTEMPTS/``), loaded back."""
        writer = SafeStorageWriter(self.root, attempt=1, step=5, options=WriterOptions(fsync=False))
        dcp_safe.save(make_state(5), checkpoint_id=SAVED, storage_writer=writer, no_dist=True)
        target = blank_like(make_state(5))
        dcp_safe.load(target, checkpoint_id=SAVED, storage_reader=self._reader(SAVED), no_dist=True)
        return self._check_loaded(target, SAVED, seed=5)

    def manager(self) -> tuple[str, bool]:
        """A manager's save (history, fencing), prune (retention, sweep) and restore."""

        def run() -> str:
            manager = CheckpointManager(self.root, keep_last=100, resume=Resume(attempt=1))
            try:
                manager.save(6, make_state(6))
                manager.wait()
                manager.prune()
                target = blank_like(make_state(6))
                name = manager.restore(target, 6)
            finally:
                manager.close()
            return self._check_loaded(target, name, seed=6)

        cell = _cell(run, self.spec["timeout_s"] * 2)
        good = _cell(lambda: _ok(verify_checkpoint(self.root, self.spec["good"])), 60)
        return cell, good == "ok"


def _ok(_: object) -> str:
    return "ok"


def _run_in_child(spec: dict[str, Any]) -> None:
    """Fork; the child writes the case's report, the parent waits for it (bounded)."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            signal.signal(signal.SIGALRM, _on_alarm)
            report = Driver(spec).report()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            Path(spec["report"]).write_text(json.dumps({"cells": report, "peak_rss_bytes": peak}))
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + spec["case_timeout_s"]
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if status != 0:
                crash = f"case process ended with status {status}"
                Path(spec["report"]).write_text(json.dumps({"crash": crash}))
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    crash = f"case process hung for {spec['case_timeout_s']} s"
    Path(spec["report"]).write_text(json.dumps({"crash": crash}))


# ---------------------------------------------------------------------------- --check-saves


def _items(root: Path, name: str) -> dict[tuple[str, Any], bytes]:
    """Every item's bytes of checkpoint ``name``, its serialization id (40 digits) zeroed."""
    manifest = json.loads((root / name / "manifest.json").read_bytes())
    found = {}
    for item in manifest["items"]:
        with open(root / name / item["file"], "rb") as f:
            f.seek(item["start"])
            data = f.read(item["length"])
        offset = None if item["offset"] is None else tuple(item["offset"])
        found[item["fqn"], offset] = re.sub(rb"[0-9]{40}", b"0" * 40, data)
    return found


def _plain_metadata(root: Path, name: str) -> Any:
    return json.loads((root / name / "manifest.json").read_bytes()).get("dcp_metadata")


def check_saves(spec: dict[str, Any]) -> dict[str, str]:
    """Each case's own save against this fresh process's save of the same state."""
    reference = Path(spec["reference"])
    writer = SafeStorageWriter(reference, attempt=1, step=5, options=WriterOptions(fsync=False))
    dcp_safe.save(make_state(5), checkpoint_id=SAVED, storage_writer=writer, no_dist=True)
    expected_items, expected_plain = _items(reference, SAVED), _plain_metadata(reference, SAVED)
    results = {}
    for case, root_text in spec["roots"].items():
        root = Path(root_text)
        if _items(root, SAVED) != expected_items:
            results[case] = "wrong: its items differ from a fresh process's"
        elif _plain_metadata(root, SAVED) != expected_plain:
            results[case] = "wrong: its DCP metadata differs from a fresh process's"
        else:
            target = blank_like(make_state(5))
            reader = SafeStorageReader(root, checkpoint_id=SAVED)
            dcp_safe.load(target, checkpoint_id=SAVED, storage_reader=reader, no_dist=True)
            results[case] = "ok" if _same(target, 5) else "wrong: it loads other values"
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--check-saves":
        check = json.loads(Path(sys.argv[2]).read_text())
        Path(check["report"]).write_text(json.dumps(check_saves(check)))
    else:
        for case_spec in json.loads(Path(sys.argv[1]).read_text()):
            try:
                os.close(os.open(case_spec["report"] + ".claimed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue  # another driver runs it
            _run_in_child(case_spec)
