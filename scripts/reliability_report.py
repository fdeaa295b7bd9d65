"""Run the reliability suites and print their figures.

The suites are ordinary pytest modules (crash consistency, N-th operation failures, corruption,
the acceptance drills); each sweep appends its figures as one JSON line to the file named by
``$DCP_SAFE_FIGURES`` (see ``tests/_crash.py``). This script runs them in one pytest process
with that side channel set, then adds the figures up:

* fork-based kill points tried, corrupt publishes, last-good losses; fresh-process SIGKILLs;
* single-byte flips (and random truncations) detected out of tried;
* N-th operation failure cases, by root and mode, and how each ended;
* peak staged memory under storage held slow, against the budget.

Why pytest and not the sweep functions directly: the figures then come from exactly the runs CI
makes, with the same fixtures (moto, temporary roots) and the same assertions.

Usage, from the repository root::

    .venv/bin/python scripts/reliability_report.py            # the default (CI) run
    .venv/bin/python scripts/reliability_report.py --long     # DCP_SAFE_LONG=1: x10 and more
    .venv/bin/python scripts/reliability_report.py --suites corruption,drills --json out.json

Exit status: 0 when every suite passed and the figures show no corrupt publish, no last-good
loss and every flip detected; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIGURES_ENV = "DCP_SAFE_FIGURES"
SUITES: dict[str, list[str]] = {
    "crash": ["tests/e2e/test_crash_consistency.py"],
    "nth": ["tests/e2e/test_nth_op.py"],
    "corruption": ["tests/e2e/test_corruption.py"],
    "drills": ["tests/e2e/test_drills.py"],
}


@dataclass
class Totals:
    """The figures of one run, added up."""

    kill_points: int = 0
    corrupt_publishes: int = 0
    last_good_losses: int = 0
    fresh_kills: int = 0
    flips_tried: int = 0
    flips_detected: int = 0
    flips_accepted_by_load: int = 0
    cuts_tried: int = 0
    cuts_detected: int = 0
    crash_lines: list[str] = field(default_factory=list)
    nth: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    drills: list[dict[str, Any]] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "crash":
            self.kill_points += int(record["kill_points"])
            self.corrupt_publishes += int(record["corrupt_publishes"])
            self.last_good_losses += int(record["last_good_losses"])
            self.crash_lines.append(
                f"  {record['suite']}: {record['kill_points']} kill points, "
                f"{record['corrupt_publishes']} corrupt, {record['last_good_losses']} lost"
            )
        elif kind == "fresh":
            self.fresh_kills += int(record["kills"])
        elif kind == "flips":
            self.flips_tried += int(record["tried"])
            self.flips_detected += int(record["detected_by_verify"])
            self.flips_accepted_by_load += int(record["accepted_by_load"])
        elif kind == "truncations":
            self.cuts_tried += int(record["tried"])
            self.cuts_detected += int(record["detected"])
        elif kind == "nth_op":
            key = f"{record['root']} {record['mode']}"
            for name, value in record.items():
                if isinstance(value, int):
                    self.nth[key][name] = self.nth[key].get(name, 0) + value
        elif kind == "drill":
            self.drills.append(record)

    @property
    def clean(self) -> bool:
        return (
            self.corrupt_publishes == 0
            and self.last_good_losses == 0
            and self.flips_detected == self.flips_tried
            and self.flips_accepted_by_load == 0
            and self.cuts_detected == self.cuts_tried
        )


def read_figures(lines: Iterable[str]) -> Totals:
    """Add up the JSON lines the suites wrote."""
    totals = Totals()
    for line in lines:
        if line.strip():
            totals.add(json.loads(line))
    return totals


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def render(totals: Totals, *, long: bool, pytest_status: int, wall_s: float) -> str:
    """The report, as text."""
    out = [
        f"dcp_safe reliability report ({'long' if long else 'default'} run, "
        f"pytest exit {pytest_status}, {wall_s:.0f} s)",
        "",
        f"fork kill points tried      {totals.kill_points}",
        f"  corrupt publishes         {totals.corrupt_publishes}",
        f"  last-good losses          {totals.last_good_losses}",
        *totals.crash_lines,
        f"fresh-process SIGKILLs      {totals.fresh_kills}",
        f"byte flips detected         {totals.flips_detected} / {totals.flips_tried} "
        f"({_percent(totals.flips_detected, totals.flips_tried)}); "
        f"accepted by load: {totals.flips_accepted_by_load}",
        f"truncations detected        {totals.cuts_detected} / {totals.cuts_tried}",
    ]
    for key, figures in sorted(totals.nth.items()):
        out.append(
            f"nth-op {key:<20} {figures.get('cases', 0)} cases over "
            f"{figures.get('operations', 0)} ops: {figures.get('failed_cleanly', 0)} failed "
            f"cleanly, {figures.get('succeeded', 0)} succeeded, "
            f"{figures.get('failed_after_commit', 0)} failed after commit (whole), "
            f"{figures.get('blocked_until_swept', 0)} name blocked until swept, "
            f"{figures.get('broken_publishes', 0)} broken publishes"
        )
    for drill in totals.drills:
        out.append(
            f"held slow ({drill['when_busy']}): {drill['requests']} requests, "
            f"{drill['started']} saves; peak staged {drill['peak_pool_bytes']} B "
            f"({_percent(drill['peak_pool_bytes'], drill['budget_bytes'])} of the "
            f"{drill['budget_bytes']} B budget; state {drill['state_bytes']} B)"
        )
    out.append("")
    out.append("CLEAN" if totals.clean and pytest_status == 0 else "NOT CLEAN")
    return "\n".join(out)


def run_suites(suites: Sequence[str], *, long: bool, figures: Path, extra: Sequence[str]) -> int:
    """Run the suites' test files in one pytest process; return pytest's exit status."""
    files = [f for suite in suites for f in SUITES[suite]]
    env = {**os.environ, FIGURES_ENV: str(figures)}
    if long:
        env["DCP_SAFE_LONG"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *extra]
    return subprocess.run(command, cwd=REPO, env=env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="DCP_SAFE_LONG=1: the long sweeps")
    parser.add_argument(
        "--suites",
        default=",".join(SUITES),
        help=f"comma-separated, from {', '.join(SUITES)} (default: all)",
    )
    parser.add_argument("--json", type=Path, help="also write the totals here, as JSON")
    parser.add_argument("-k", dest="keyword", help="passed to pytest -k (to run a subset)")
    parser.add_argument(
        "--figures",
        type=Path,
        help="keep the suites' JSON lines here (appended as each sweep ends; default: a "
        "temporary file)",
    )
    args = parser.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        parser.error(f"unknown suites {unknown}; known: {sorted(SUITES)}")
    extra = ["-k", args.keyword] if args.keyword else []
    with tempfile.TemporaryDirectory(prefix="dcp-safe-figures-") as scratch:
        figures = args.figures or Path(scratch) / "figures.jsonl"
        figures.write_text("", encoding="utf-8")
        started = time.monotonic()
        status = run_suites(suites, long=args.long, figures=figures, extra=extra)
        wall_s = time.monotonic() - started
        totals = read_figures(figures.read_text(encoding="utf-8").splitlines())
    print(render(totals, long=args.long, pytest_status=status, wall_s=wall_s))
    if args.json is not None:
        payload = {k: v for k, v in vars(totals).items() if k != "crash_lines"}
        payload.update(pytest_status=status, wall_s=wall_s, long=args.long, clean=totals.clean)
        args.json.write_text(json.dumps(payload, indent=2, default=dict), encoding="utf-8")
    return 0 if status == 0 and totals.clean else 1


if __name__ == "__main__":
    sys.exit(main())
