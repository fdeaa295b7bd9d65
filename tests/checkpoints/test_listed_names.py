"""Listed names are judged by the name rule, and shown escaped; ``latest`` on S3 costs listings.

A writer of the root chooses the names listed under it. One that breaks the name rule (a
terminal escape sequence, a line break, a reserved word) is never a checkpoint, whatever it
holds (here: a whole checkpoint re-signed under that name, at a later step, so that it would
become ``latest``): it is passed by with one warning, escaped, on a local root and on S3, and
nothing dcp_safe logs or prints carries a control character. On an object store, which
entries hold a marker is read from listings: a ``latest`` costs the same requests with 40
stray entries under the root as with 80.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
from support import make_state

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions, layout, list_checkpoints
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import committed_names, resolve_name
from dcp_safe.cli import main as cli_main
from dcp_safe.manifest.schema import manifest_digest
from dcp_safe.testing.s3_proxy import FaultProxy

GOOD = ("step_0001", "step_0002")
# Each would be a checkpoint but for its name: escape sequences, a line break, bidi, reserved.
ODD = ["evil\x1b]0;pwned\x07\x1b[2J", "two\nlines", "gpj.\u202eexe", "latest", "_ATTEMPTS"]
# moto's server takes no line break in a key (AWS does): a tab stands in for it there.
ODD_S3 = [name.replace("\n", "\t") for name in ODD]
_ACTIVE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _save(url: str, options: dict[str, Any] | None, step: int) -> None:
    writer = SafeStorageWriter(
        url, storage_options=options, options=WriterOptions(fsync=False), step=step
    )
    dcp_safe.save(make_state(step), checkpoint_id=f"step_{step:04d}", storage_writer=writer)


def _plant(fs: fsspec.AbstractFileSystem, root: str, good: str, name: str) -> None:
    """``good``'s manifest and marker under ``name``, re-signed as checkpoint ``name`` at step
    99: what a writer of the root can make (old code listed it, and took it for ``latest``)."""
    raw = json.loads(fs.cat_file(f"{root}/{good}/{layout.MANIFEST}"))
    raw.update(name=name, step=99)
    data = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    fs.pipe_file(f"{root}/{name}/{layout.MANIFEST}", data)
    fs.pipe_file(f"{root}/{name}/{layout.COMMITTED_MARKER}", manifest_digest(data).encode())


def _check_listing(url: str, options: dict[str, Any] | None, caplog: Any) -> None:
    damaged: list[str] = []
    with caplog.at_level(logging.WARNING, logger="dcp_safe"):
        listed = list_checkpoints(
            url, storage_options=options, on_damaged=lambda n, e: damaged.append(n)
        )
        latest = resolve_name(open_backend(url, options), layout.LATEST)
    assert [info.name for info in listed] == list(GOOD) and damaged == []
    assert latest == GOOD[-1]
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("dcp_safe")]
    assert not [m for m in messages if _ACTIVE.search(m)], messages
    assert any("evil\\x1b]0;pwned\\x07" in m and "not a checkpoint name" in m for m in messages)


def _check_cli(url: str, options: dict[str, Any] | None) -> None:
    extra = ["--storage-options", json.dumps(options)] if options else []
    for argv in (["ls", url, *extra], ["ls", url, "--json", *extra], ["verify", url, *extra]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert cli_main(argv) == 0
        text = out.getvalue() + err.getvalue()
        assert not _ACTIVE.search(text), text
        assert GOOD[-1] in out.getvalue()


def test_odd_names_on_a_local_root_are_passed_by_escaped(tmp_path: Path, caplog: Any) -> None:
    root = tmp_path / "root"
    for step in (1, 2):
        _save(str(root), None, step)
    fs = fsspec.filesystem("file")
    for name in ODD:
        shutil.copytree(root / GOOD[-1], root / name)
        _plant(fs, str(root), GOOD[-1], name)
    _check_listing(str(root), None, caplog)
    _check_cli(str(root), None)


@pytest.mark.s3
def test_odd_names_on_s3_are_passed_by_escaped(
    s3_root: str, s3_options: dict[str, Any], caplog: Any
) -> None:
    for step in (1, 2):
        _save(s3_root, s3_options, step)
    fs = fsspec.filesystem("s3", **s3_options)
    root = s3_root.removeprefix("s3://")
    for name in ODD_S3:
        _plant(fs, root, GOOD[-1], name)
    _check_listing(s3_root, s3_options, caplog)
    _check_cli(s3_root, s3_options)


@pytest.mark.s3
def test_latest_on_s3_costs_listing_pages_not_a_request_per_entry(
    s3_root: str, proxy: FaultProxy
) -> None:
    options = proxy.storage_options()
    for step in (1, 2):
        _save(s3_root, options, step)
    backend = open_backend(s3_root, options)
    costs = []
    for count in (40, 80):
        for index in range(count):  # leftovers of failed saves, stray uploads, anything
            backend.write_bytes(f"stray_{index:03d}/{layout.SHARD_SUFFIX}", b"x")
        before = proxy.requests_seen
        assert resolve_name(open_backend(s3_root, options), layout.LATEST) == GOOD[-1]
        costs.append(proxy.requests_seen - before)
    assert costs[0] == costs[1], costs


@pytest.mark.s3
def test_a_listing_on_s3_walks_the_root_once_trash_included(
    s3_root: str, proxy: FaultProxy
) -> None:
    """Which names hold a commit marker and which a trash marker too come from one walk: a
    listing costs what one walk of the root costs, not two."""
    options = proxy.storage_options()
    for step in (1, 2):
        _save(s3_root, options, step)
    backend = open_backend(s3_root, options)
    backend.write_bytes(f"{GOOD[0]}/{layout.TRASH_MARKER}", b"x")  # a prune stopped halfway
    before = proxy.requests_seen
    list(open_backend(s3_root, options).walk_files(""))
    walk = proxy.requests_seen - before
    before = proxy.requests_seen
    assert committed_names(open_backend(s3_root, options)) == [GOOD[1]]
    assert proxy.requests_seen - before == walk > 0
