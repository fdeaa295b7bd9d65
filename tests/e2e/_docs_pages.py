"""Runs markdown pages' code blocks, each page in a fresh process, as a reader pastes them.

Started once by tests/e2e/test_docs.py. It imports torch, dcp_safe and moto once, then forks a
child per page (a reader's fresh session, for the price of a fork): the child runs the page's
blocks in order in an empty working directory, python blocks in one ``__main__`` namespace, bash
blocks with ``bash -euo pipefail`` and the environment the page started with, then runs the
session's exit handlers. With ``pasted``, python blocks are typed line by line into an
interactive interpreter (``code.InteractiveConsole``), as a reader pastes them into ``python``.
Requests and replies are JSON lines on stdin and stdout; up to ``argv[1]`` pages (2) run at
once, and each reply comes when its page ends::

    {"id": "3", "page": "/abs/README.md", "cwd": "/tmp/x", "log": "/tmp/x.log",
     "timeout_s": 240, "pasted": true}
    {"id": "3", "ok": false, "where": "README.md:61", "error": "Traceback ..."}
"""

from __future__ import annotations

import atexit
import code
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
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


@dataclass
class _Running:
    request: dict[str, Any]
    deadline: float


def _start(request: dict[str, Any]) -> int:
    page, cwd, log = Path(request["page"]), Path(request["cwd"]), Path(request["log"])
    pid = os.fork()
    if pid == 0:
        _child(page, cwd, log, log.with_suffix(".result"), bool(request.get("pasted")))
    return pid


def _finished(pid: int, running: _Running) -> dict[str, Any] | None:
    """The reply for a page's process, once it has ended (killed at its deadline); else None."""
    page, log = Path(running.request["page"]), Path(running.request["log"])
    done, raw = os.waitpid(pid, os.WNOHANG)
    if not done and time.monotonic() < running.deadline:
        return None
    if not done:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"ok": False, "where": page.name, "error": "timed out"}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # what the page left running
    status = os.waitstatus_to_exitcode(raw)
    result = log.with_suffix(".result")
    reply: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if status != 0 and "error" not in reply:
        reply = {"where": page.name, "error": f"the page's process ended with {status}"}
    return {"ok": status == 0, **reply}


def main(slots: int) -> None:
    """Serve requests as they come, ``slots`` pages at a time, each reply when its page ends.
    No thread: the pages are forked from this process."""
    pending: list[dict[str, Any]] = []
    running: dict[int, _Running] = {}
    buffered, reading = b"", True
    while reading or pending or running:
        if reading and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            *lines, buffered = (buffered + chunk).split(b"\n")
            pending += [json.loads(line) for line in lines if line.strip()]
        elif not reading:
            time.sleep(0.05)
        while pending and len(running) < slots:
            request = pending.pop(0)
            running[_start(request)] = _Running(request, time.monotonic() + request["timeout_s"])
        for pid, page in list(running.items()):
            reply = _finished(pid, page)
            if reply is not None:
                del running[pid]
                print(json.dumps({"id": page.request["id"], **reply}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
