"""Every code example in README.md and docs/*.md runs as pasted, on a fresh clone.

The convention (docs authors: write to it; this test enforces it):

* A page is one reader's session. Its ``python`` blocks run in document order in one
  ``__main__`` namespace (a later block may use names an earlier one defined), its ``bash``
  blocks with ``bash -euo pipefail`` and the environment the page started with (the virtual
  environment's ``bin`` first on ``PATH``), all in one fresh, empty working directory and one
  fresh process per page: nothing else is set up. An S3 example starts its own local S3 with
  ``dcp_safe.testing.s3.use_local_s3("bucket")`` (moto on 127.0.0.1, a free port, dummy
  credentials in ``AWS_*``); a bash block sees none of that, so keep S3 out of bash blocks. The
  host's own ``AWS_*`` variables are removed, so no example can reach a real account. A
  block that needs several ranks runs them itself (``torchrun ...`` in a bash block).
* ``text`` and ``json`` blocks show something (output, a file, a formula) and never run.
* Any other block, and a ``python`` or ``bash`` block that cannot run here (real AWS, GPUs,
  minutes of benchmarks), is marked on the line before it with ``<!-- not run: why -->``.
  A block with no language, or another one, and no such mark fails this test.
* README.md's python blocks are pasted line by line into ``python``'s interactive interpreter,
  the first thing a reader tries: an indented block there ends with a blank line.
* Budget: a few seconds per page; the whole file under 90 s on a loaded 2-core machine.
  Only a hang fails for time (a generous per-page deadline); nothing here measures speed.

New files under docs/ are picked up automatically. The pages run in
``tests/e2e/_docs_pages.py``, which imports torch once and forks a process per page, two pages
at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from e2e._docs_blocks import REPO, doc_files, parse_blocks

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(600)]

# Generous: only a guard against a hung example, never a measure of speed.
_PAGE_TIMEOUT_S = 240
_RUNNER = Path(__file__).with_name("_docs_pages.py")
# Pages whose python blocks are pasted line by line into ``python``'s interactive interpreter
# (the first thing a reader tries): an indented block must end with a blank line there.
_PASTED = {"README.md"}


class _Pages:
    """The page runner: pages submitted ahead run two at a time; ``result`` waits for one."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(_RUNNER), "2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.replies: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, Path] = {}

    def submit(self, page: Path, workdir: Path, *, pasted: bool = False) -> str:
        """Queue ``page``'s blocks to run in ``workdir`` (``pasted``: python blocks line by line
        into an interactive interpreter); the request's id."""
        cwd, log = workdir / "cwd", workdir / "page.log"
        cwd.mkdir(parents=True)
        ident = str(len(self.logs))
        self.logs[ident] = log
        request = {"id": ident, "page": str(page), "cwd": str(cwd), "log": str(log)}
        stdin, _ = self._pipes()
        stdin.write(json.dumps({**request, "pasted": pasted, "timeout_s": _PAGE_TIMEOUT_S}))
        stdin.write("\n")
        stdin.flush()
        return ident

    def result(self, ident: str) -> tuple[dict[str, Any], str]:
        """The reply for request ``ident`` and what its page printed."""
        _, stdout = self._pipes()
        while ident not in self.replies:
            line = stdout.readline()
            if not line:
                raise AssertionError(f"the page runner died (exit {self.proc.wait(timeout=30)})")
            reply = json.loads(line)
            self.replies[reply["id"]] = reply
        log = self.logs[ident]
        return self.replies[ident], log.read_text(errors="replace") if log.exists() else ""

    def run(self, page: Path, workdir: Path, *, pasted: bool = False) -> tuple[dict[str, Any], str]:
        return self.result(self.submit(page, workdir, pasted=pasted))

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return self.proc.stdin, self.proc.stdout

    def close(self) -> None:
        stdin, stdout = self._pipes()
        stdin.close()  # the runner ends once the pages queued have (each within its deadline)
        try:
            self.proc.wait(timeout=_PAGE_TIMEOUT_S * 2)
        finally:
            self.proc.kill()
            self.proc.wait()
            stdout.close()


@pytest.fixture(scope="module")
def pages() -> Iterator[_Pages]:
    runner = _Pages()
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="module")
def submitted(
    pages: _Pages, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[Path, str]:
    """Every selected page with a block to run, submitted at once: they run while earlier
    pages' results are checked."""
    selected = [
        item.callspec.params["page"]
        for item in request.session.items
        if item.path == Path(__file__) and getattr(item, "originalname", "") == "test_examples_run"
    ]
    return {
        page: pages.submit(page, tmp_path_factory.mktemp(page.stem), pasted=page.name in _PASTED)
        for page in selected
        if any(block.runs for block in parse_blocks(page))
    }


def _explain(reply: dict[str, Any], output: str) -> str:
    return (
        f"block at {reply.get('where')} failed:\n{reply.get('error')}\n--- output\n{output[-6000:]}"
    )


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.name)
def test_examples_run(page: Path, pages: _Pages, submitted: dict[Path, str]) -> None:
    if page not in submitted:
        pytest.skip(f"{page.name} has no block to run")
    reply, output = pages.result(submitted[page])
    assert reply["ok"], _explain(reply, output)
    assert reply["ran"] == [b.where for b in parse_blocks(page) if b.runs]


def test_every_block_runs_or_says_why_not() -> None:
    undecided = [
        f"{block.where} ({block.language or 'no language'})"
        for page in doc_files()
        for block in parse_blocks(page)
        if not block.accounted_for
    ]
    assert undecided == [], "give these python/bash (run), text/json, or <!-- not run: why -->"


_SAMPLE = """\
# A page

```python
x = 1
```

```text
not code at all
```

<!-- not run: needs eight GPUs -->

```python
raise RuntimeError("a marked block ran")
```

```bash
test -f written_by_python || exit 3
```
"""


def test_the_runner_runs_unmarked_blocks_and_skips_marked_ones(
    pages: _Pages, tmp_path: Path
) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text(_SAMPLE.replace("x = 1", "open('written_by_python', 'w').close()"))
    reply, output = pages.run(sample, tmp_path / "good")
    assert reply["ok"], _explain(reply, output)
    assert [w.rsplit(":", 1)[1] for w in reply["ran"]] == ["4", "18"]


def test_an_unmarked_block_that_fails_fails_the_page(pages: _Pages, tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text(_SAMPLE.replace("x = 1", "x = undefined_name"))
    reply, _ = pages.run(sample, tmp_path / "python")
    assert not reply["ok"] and reply["where"] == "sample.md:4" and "NameError" in reply["error"]
    sample.write_text(_SAMPLE)  # the bash block finds no file
    reply, _ = pages.run(sample, tmp_path / "bash")
    assert not reply["ok"] and reply["where"] == "sample.md:18" and "exited 3" in reply["error"]


def test_a_block_that_does_not_paste_fails_a_pasted_page(pages: _Pages, tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    loop = "for i in range(2):\n    open(f'f{i}', 'w').close()\n"
    sample.write_text(f"```python\n{loop}print('after')\n```\n")
    reply, output = pages.run(sample, tmp_path / "script")
    assert reply["ok"], _explain(reply, output)  # fine as a script
    reply, _ = pages.run(sample, tmp_path / "pasted", pasted=True)
    assert not reply["ok"] and "SyntaxError" in reply["error"]  # the REPL needs a blank line
    sample.write_text(f"```python\n{loop}\nprint('after')\n```\n")
    reply, output = pages.run(sample, tmp_path / "fixed", pasted=True)
    assert reply["ok"], _explain(reply, output)
    assert "after" in output and (tmp_path / "fixed" / "cwd" / "f1").exists()


def test_the_parser_reads_languages_marks_and_line_numbers(tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text(
        "intro\n```python\nx = 1\n```\n\n```text\nout\n```\n"
        "<!-- not run: slow -->\n````bash\necho ```\n````\n```\nplain\n```\n"
    )
    blocks = parse_blocks(sample)
    assert [(b.language, b.line, b.code, b.marked) for b in blocks] == [
        ("python", 3, "x = 1\n", False),
        ("text", 7, "out\n", False),
        ("bash", 11, "echo ```\n", True),
        ("", 14, "plain\n", False),
    ]
    assert [b.runs for b in blocks] == [True, False, False, False]
    assert [b.accounted_for for b in blocks] == [True, True, True, False]


def test_every_doc_file_is_collected() -> None:
    names = {p.name for p in doc_files()}
    assert {"README.md", "architecture.md", "s3.md", "capacity.md", "runbook.md"} <= names
