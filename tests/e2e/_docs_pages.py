"""Runs markdown pages' code blocks, each page in a fresh process, as a reader pastes them.

Started once by tests/e2e/test_docs.py. It imports torch, dcp_safe and moto once, then forks a
child per page (a reader's fresh session, for the price of a fork): the child runs the page's
blocks in order in an empty working directory, python blocks in one ``__main__`` namespace, bash
blocks with ``bash -euo pipefail`` and the environment the page started with, then runs the
session's exit handlers. With ``pasted``, python blocks are typed line by line into an
interactive interpreter (``code.InteractiveConsole``), as a reader pastes them into ``python``.
Requests and replies are JSON lines on stdin and stdout::

    {"page": "/abs/README.md", "cwd": "/tmp/x", "log": "/tmp/x.log", "timeout_s": 240,
     "pasted": true}
    {"ok": false, "where": "README.md:61", "error": "Traceback ..."}
"""

from __future__ import annotations

import atexit
import code
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# What the pages import, loaded once here rather than once per page.
import boto3  # noqa: F401
import moto.server  # noqa: F401
import s3fs  # noqa: F401
import torch
import torch.distributed.checkpoint  # noqa: F401

import dcp_safe.adapters.api
import dcp_safe.manager  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs_blocks import Block, parse_blocks


def _run_bash(block: Block, env: dict[str, str]) -> None:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bash block exited {done.returncode} (its output is in the log)")


class _Pasted(code.InteractiveConsole):
    """The interactive interpreter a reader pastes into, line by line; an error stops the page
    instead of being printed."""

    def runcode(self, code: Any) -> None:
        exec(code, self.locals)

    def showsyntaxerror(self, filename: str | None = None, **kwargs: Any) -> None:
        raise  # the SyntaxError being handled: a block that does not paste


def _run_python(block: Block, namespace: dict[str, Any], pasted: bool) -> None:
    if pasted:
        console = _Pasted(namespace, filename=block.where)
        for line in [*block.code.splitlines(), ""]:  # the blank line ends an open statement
            console.push(line)
        return
    # Padding keeps line numbers in tracebacks equal to the markdown file's.
    source = "\n" * (block.line - 1) + block.code
    exec(compile(source, str(block.path), "exec"), namespace)


def _run_page(page: Path, result: Path, pasted: bool) -> int:
    """The child: every runnable block of ``page``; the first failure is written to ``result``.
    ``pasted``: python blocks go through the interactive interpreter, line by line."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    namespace: dict[str, Any] = {"__name__": "__main__"}
    ran: list[str] = []
    for block in parse_blocks(page):
        if not block.runs:
            continue
        print(f"===== {block.where} [{block.language}]", flush=True)
        try:
            if block.language == "python":
                _run_python(block, namespace, pasted)
            else:
                _run_bash(block, env)
        except BaseException:
            result.write_text(json.dumps({"where": block.where, "error": traceback.format_exc()}))
            return 1
        ran.append(block.where)
    result.write_text(json.dumps({"ran": ran}))
    return 0


def _child(page: Path, cwd: Path, log: Path, result: Path, pasted: bool) -> None:
    os.setpgid(0, 0)  # one group: a timeout ends the page's every process
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(cwd)
    # Nothing of the host's AWS setup: an S3 example that forgot its local S3 fails here,
    # rather than reaching a real account.
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_CONFIG_FILE=os.devnull,
    )
    status = 1
    try:
        status = _run_page(page, result, pasted)
        atexit._run_exitfuncs()  # as the reader's session ends: managers drain, servers stop
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    page, cwd, log = Path(request["page"]), Path(request["cwd"]), Path(request["log"])
    result = log.with_suffix(".result")
    pid = os.fork()
    if pid == 0:
        _child(page, cwd, log, result, bool(request.get("pasted")))
    deadline = time.monotonic() + float(request["timeout_s"])
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"ok": False, "where": page.name, "error": "timed out"}
        else:
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # what the page left running
    reply: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if status != 0 and "error" not in reply:
        reply = {"where": page.name, "error": f"the page's process ended with {status}"}
    return {"ok": status == 0, **reply}


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(_serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
