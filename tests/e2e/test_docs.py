"""Every code example in README.md and docs/*.md runs, as written.

The convention (docs authors: write to it; this test enforces it):

* A fenced block whose info string is ``python`` is executed. A file's python blocks run in
  document order, in ONE shared namespace (a later block may use names an earlier one defined),
  in this test's process: no ``torch.distributed`` process group, CPU only.
* A fenced block whose info string is ``bash`` is executed with ``bash -euo pipefail``; the
  virtual environment's ``bin`` comes first on ``PATH``, so ``dcp-safe ...`` and ``python ...``
  work. Keep them quick and use relative paths.
* Both kinds run, interleaved in document order, in the same fresh, empty temporary working
  directory per file: a bash block sees the files an earlier python block wrote, and vice versa.
* Any other info string (``text`` for sample output, ``json``, none at all) is not run. Write
  what cannot run that way (real AWS, many GPUs, ``make test``) in prose or in such a block.
* S3: for a file that mentions ``s3://``, a fresh moto S3 server is started on 127.0.0.1 with an
  empty bucket named ``bucket``, and the standard AWS variables point every client at it:
  ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``.
  So ``s3://bucket/...`` works in examples with no ``storage_options``, exactly as it does for
  a user whose environment names an endpoint and credentials.
* Budget: about 30 s per file on a loaded 2-core machine. Only a hang fails for time (each bash
  block has a generous deadline); nothing here measures speed.

New files under docs/ are picked up automatically.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parents[2]
BUCKET = "bucket"
# Generous: only a guard against a hung example, never a measure of speed.
_BASH_TIMEOUT_S = 240

_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`\n]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    path: Path
    line: int
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, in order; the info string's first word is the
    language (``python``, ``bash``, ``text``, or empty)."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        fence, info = opened["fence"], opened["info"].strip()
        start = i + 1
        i = start
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        language = info.split()[0].lower() if info else ""
        blocks.append(Block(path, start + 1, language, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return blocks


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_parser_reads_languages_and_line_numbers(tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text(
        "intro\n```python\nx = 1\n```\n\n```text\nout\n```\n"
        "````bash\necho ```\n````\n```\nplain\n```\n"
    )
    blocks = parse_blocks(sample)
    assert [(b.language, b.line, b.code) for b in blocks] == [
        ("python", 3, "x = 1\n"),
        ("text", 7, "out\n"),
        ("bash", 10, "echo ```\n"),
        ("", 13, "plain\n"),
    ]


def test_every_doc_file_is_collected() -> None:
    names = {p.name for p in doc_files()}
    assert {"README.md", "architecture.md", "s3.md", "capacity.md", "runbook.md"} <= names


@pytest.fixture
def s3_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For files that mention s3://: the session's moto server, an empty ``bucket``, the AWS
    variables."""
    path: Path = request.param
    if "s3://" not in path.read_text(encoding="utf-8"):
        yield
        return
    import s3fs

    from dcp_safe.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY

    server = request.getfixturevalue("s3")
    try:
        _fresh_bucket(server.client())
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        # fsspec caches file systems by their arguments, not by the environment: start clean.
        s3fs.S3FileSystem.clear_instance_cache()
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def _fresh_bucket(client: Any) -> None:
    """An empty ``bucket``: the server (and moto's state) is the session's."""
    names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if BUCKET in names:
        for upload in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=BUCKET, Key=obj["Key"])
        client.delete_bucket(Bucket=BUCKET)
    client.create_bucket(Bucket=BUCKET)


def _run_bash(block: Block, cwd: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=_BASH_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (
        f"bash block at {block.where} exited {done.returncode}\n"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )


def _run_python(block: Block, namespace: dict[str, object]) -> None:
    # Padding keeps line numbers in tracebacks equal to the markdown file's.
    code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
    exec(code, namespace)


@pytest.mark.parametrize("s3_env", doc_files(), ids=lambda p: p.name, indirect=True)
def test_examples_run(
    s3_env: None, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path: Path = request.node.callspec.params["s3_env"]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs:{path.name}"}
    ran = 0
    for block in parse_blocks(path):
        if block.language == "python":
            _run_python(block, namespace)
        elif block.language == "bash":
            _run_bash(block, tmp_path)
        else:
            continue
        ran += 1
    if ran == 0:
        pytest.skip(f"{path.name} has no python or bash blocks")
