"""``dcp-safe`` for scripts: ``--json`` of every subcommand against its schema
(:data:`dcp_safe.cli_schemas.SCHEMAS`), ``history``, ``show``, ``diff`` and ``replicate`` on
real checkpoints, the exit codes, and which verbs start without importing torch.

Checkpoints are written by the real manager and ``dcp_safe.save`` into tmp dirs; most cases
call ``main([...])`` in-process, the startup cases run the CLI in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_safe
from dcp_safe import (
    CheckpointManager,
    Retention,
    SafeStorageWriter,
    SavePolicy,
    WriterOptions,
    layout,
)
from dcp_safe.cli import main
from dcp_safe.cli_output import (
    EXIT_CODES,
    EXIT_EXISTS,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
)
from dcp_safe.cli_schemas import SCHEMAS

# Generous: only a guard against a hung subprocess, never a measure of speed.
_SUBPROCESS_TIMEOUT_S = 300
_KEY = "k" * 32

_SCALARS = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float),
    "bool": lambda v: type(v) is bool,
    "object": lambda v: isinstance(v, dict),
}


def _conform(doc: Any, schema: Any, where: str = "$") -> None:
    """Raise AssertionError unless ``doc`` has exactly the shape ``schema`` describes."""
    if isinstance(schema, dict):
        assert isinstance(doc, dict), f"{where}: not an object"
        assert doc.keys() == schema.keys(), f"{where}: keys {sorted(doc.keys() ^ schema.keys())}"
        for key, inner in schema.items():
            _conform(doc[key], inner, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(doc, list), f"{where}: not an array"
        for index, value in enumerate(doc):
            _conform(value, schema[0], f"{where}[{index}]")
    else:
        nullable, base = schema.endswith("?"), schema.rstrip("?")
        if doc is None:
            assert nullable, f"{where}: null"
        elif base.endswith("[]"):
            assert isinstance(doc, list), f"{where}: not an array"
            for index, value in enumerate(doc):
                _conform(value, base[:-2], f"{where}[{index}]")
        else:
            assert _SCALARS[base](doc), f"{where}: {doc!r} is not {base}"


def _state(step: int) -> dict[str, Any]:
    return {"frozen": torch.arange(8.0), "w": torch.full((4, 4), float(step)), "step": step}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _json(capsys: pytest.CaptureFixture[str], command: str, *argv: str) -> Any:
    """Run ``command`` with ``--json``: exit 0, and one document of its schema on stdout."""
    status, out, err = _run(capsys, command, *argv, "--json")
    assert status == EXIT_OK, err
    doc = json.loads(out)
    _conform(doc, SCHEMAS[command])
    return doc


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root a manager saved steps 2 and 4 to (its history holds what it did), plus
    ``signed``, saved with a signing key and one key more."""
    path = tmp_path / "run"
    with CheckpointManager(path, policy=SavePolicy(every=2)) as manager:
        for step in range(1, 5):
            handle = manager.maybe_save(step, _state(step))
            if handle is not None:
                handle.committed.result(timeout=_SUBPROCESS_TIMEOUT_S)
    options = WriterOptions(fsync=False, signing_key=_KEY)
    state = {**_state(4), "extra": torch.zeros(3)}
    writer = SafeStorageWriter(path, options=options)
    dcp_safe.save(state, checkpoint_id="signed", storage_writer=writer)
    return path


# ------------------------------------------------------------------------- the schemas


def test_the_schema_check_refuses_a_key_added_left_out_or_of_another_type() -> None:
    schema = {"a": "int", "b": "str[]?", "c": [{"d": "bool"}]}
    _conform({"a": 1, "b": None, "c": [{"d": True}]}, schema)
    for bad in (
        {"a": 1, "b": None, "c": [], "e": 0},
        {"a": 1, "c": []},
        {"a": True, "b": None, "c": []},
        {"a": 1, "b": [1], "c": []},
        {"a": 1, "b": None, "c": [{"d": None}]},
    ):
        with pytest.raises(AssertionError):
            _conform(bad, schema)


def test_every_subcommand_with_json_has_a_schema_and_a_test_here() -> None:
    tested = {"ls", "verify", "inspect", "export", "gc", "history", "show", "diff", "replicate"}
    tested.add("adopt")
    assert set(SCHEMAS) == tested | {"error"}
    source = Path(__file__).read_text(encoding="utf-8")
    for command in tested:
        assert f'_json(capsys, "{command}"' in source, command


def test_ls_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json(capsys, "ls", str(root))
    assert [r["name"] for r in rows] == ["signed", "step_000000002", "step_000000004"]


def test_verify_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "verify", str(root), "step_000000004")
    assert doc["ok"] and doc["deep"] and doc["pickle_checked"] and not doc["signature_checked"]
    assert doc["files_checked"] >= 2 and doc["bytes_read"] > 0
    key_file = root.parent / "key"
    key_file.write_text(_KEY)
    doc = _json(
        capsys, "verify", str(root), "signed", "--quick", "--signing-key-file", str(key_file)
    )
    assert doc["signature_checked"] and not doc["deep"] and doc["items_checked"] == 0


def test_inspect_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "inspect", str(root), "latest")
    by_key = {e["fqn"]: e for e in doc["entries"]}
    assert by_key["w"]["shape"] == [4, 4] and by_key["step"]["kind"] == "object"


def test_export_json(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out"
    doc = _json(capsys, "export", str(root), "step_000000002", str(dest))
    assert doc["name"] == "step_000000002" and doc["tensors"] == 2
    assert sorted(doc["files"]) == sorted(p.name for p in dest.iterdir())
    assert doc["skipped"] == {"step": doc["skipped"]["step"]}  # the object: not a tensor


def test_gc_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "gc", str(root), "--keep", "1", "--dry-run")
    assert doc["dry_run"] and doc["removed"] == [] and "step_000000004" in doc["kept"]


def test_metrics_and_the_trash_through_ls_show_inspect_history_and_gc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, losses = tmp_path / "best", {1: 0.25, 2: 0.5, 3: 0.75}
    retention = Retention(keep_last=1, trash_grace_s=3600.0)
    with CheckpointManager(path, retention=retention) as manager:
        for step, loss in losses.items():
            metrics = {"val_loss": loss, "config": "sha256:ab"}
            manager.save(step, _state(step), metrics=metrics).committed.result()  # type: ignore[union-attr]
    listed = _json(capsys, "ls", str(path))
    assert [c["metrics"]["val_loss"] for c in listed] == [0.5, 0.75]
    assert "config=sha256:ab, val_loss=0.5" in _run(capsys, "ls", str(path))[1]
    kept = _json(capsys, "gc", str(path), "--keep", "5", "--trash-grace-s", "3600")
    assert len(kept["trash_kept"]) == 1 and kept["trash_removed"] == []
    restored = _json(capsys, "gc", str(path), "--restore", "step_000000001")
    assert restored["restored"] == ["step_000000001"] and restored["kept"] == []
    shown = _json(capsys, "show", str(path), "step_000000001")
    assert shown["metrics"] == {"val_loss": 0.25, "config": "sha256:ab"}
    assert _json(capsys, "inspect", str(path), "step_000000001")["metrics"] == shown["metrics"]
    events = _json(capsys, "history", str(path), "--event", "committed")["events"]
    assert [e["fields"]["metrics"]["val_loss"] for e in events] == list(losses.values())
    again = _run(capsys, "gc", str(path), "--restore", "step_000000001")
    assert again[0] == EXIT_NOT_FOUND and "not in the trash" in again[2]


def test_history_json_is_the_managers_record(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _json(capsys, "history", str(root))
    committed = [(e["step"], e["name"]) for e in doc["events"] if e["event"] == "committed"]
    assert committed == [(2, "step_000000002"), (4, "step_000000004")]
    assert [e["event"] for e in doc["events"]] == [
        e["event"] for e in dcp_safe.CheckpointManager(root).history()
    ]
    assert all(e["time"] > 0 for e in doc["events"])
    only = _json(capsys, "history", str(root), "--event", "committed", "--last", "1")
    assert [(e["event"], e["step"]) for e in only["events"]] == [("committed", 4)]


def test_history_table_and_an_empty_history(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "history", str(root))
    assert status == EXIT_OK and "committed" in out and "step_000000004" in out
    (tmp_path / "empty").mkdir()
    status, out, _ = _run(capsys, "history", str(tmp_path / "empty"))
    assert status == EXIT_OK and "no events recorded" in out
    assert _json(capsys, "history", str(tmp_path / "empty"))["events"] == []


def test_show_json_summarises_the_manifest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "show", str(root), "step_000000004")
    manifest = dcp_safe.list_checkpoints(root)[-1]
    assert (doc["name"], doc["step"], doc["world_size"]) == ("step_000000004", 4, 1)
    assert doc["total_bytes"] == manifest.size_bytes and doc["save_id"] == manifest.save_id
    assert doc["format"] == "dcp" and doc["signature"] is None
    keys = {k["key"]: k for k in doc["keys"]}
    assert sorted(keys) == ["frozen", "step", "w"]
    assert (keys["w"]["kind"], keys["w"]["dtype"], keys["w"]["shape"]) == (
        "tensor",
        "float32",
        [4, 4],
    )
    assert (keys["step"]["kind"], keys["step"]["shape"]) == ("object", None)
    assert sum(k["stored_bytes"] for k in doc["keys"]) > 0
    signed = _json(capsys, "show", str(root), "signed")
    assert signed["signature"] == "hmac-sha256" and signed["step"] is None


def test_show_table(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "show", str(root), "signed")
    assert status == EXIT_OK
    assert "hmac-sha256" in out and "float32" in out and "extra" in out


def test_diff_json_names_the_keys_that_differ_by_checksum(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _json(capsys, "diff", str(root), "step_000000002", "step_000000004")
    assert doc["changed"] == ["step", "w"] and doc["unchanged"] == 1 and not doc["same"]
    assert doc["added"] == doc["removed"] == [] == doc["incomparable"]
    same = _json(capsys, "diff", str(root), "step_000000004", "step_000000004")
    assert same["same"] and same["unchanged"] == 3


def test_diff_reports_added_keys_and_keys_it_cannot_compare(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``signed`` holds one key more, and (signed) its checksums are of another algorithm.
    doc = _json(capsys, "diff", str(root), "step_000000004", "signed")
    assert doc["added"] == ["extra"] and doc["removed"] == []
    assert {e["key"] for e in doc["incomparable"]} == {"frozen", "step", "w"}
    assert all("algorithm" in e["reason"] for e in doc["incomparable"])
    status, out, _ = _run(capsys, "diff", str(root), "signed", "step_000000004")
    assert status == EXIT_OK and "removed  extra" in out and "differ" in out


def test_diff_reads_no_data(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for shard in (root / "step_000000002").glob(f"*{layout.SHARD_SUFFIX}"):
        shard.write_bytes(b"")  # the data is gone; the manifests still compare
    doc = _json(capsys, "diff", str(root), "step_000000002", "step_000000004")
    assert doc["changed"] == ["step", "w"]


def test_replicate_json_copies_commits_and_checks_at_dest(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "second"
    doc = _json(capsys, "replicate", str(root), "latest", str(dest), "--deep")
    assert doc["name"] == "step_000000004" and doc["verified"] == "deep"
    assert [i.name for i in dcp_safe.list_checkpoints(dest)] == ["step_000000004"]
    assert dcp_safe.verify_checkpoint(dest, "step_000000004").files_checked == doc["files"]
    # Again: nothing to copy, the same answer.
    assert (
        _json(capsys, "replicate", str(root), "step_000000004", str(dest))["files"] == doc["files"]
    )


@pytest.mark.s3
def test_replicate_to_s3_then_both_tiers_list_it_and_show_reads_it_there(
    root: Path, s3_root: str, s3_options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--storage-options", json.dumps(s3_options)]
    doc = _json(capsys, "replicate", str(root), "step_000000004", s3_root, *options, "--deep")
    assert doc["dest"].startswith("s3://") and doc["verified"] == "deep"
    rows = _json(capsys, "ls", str(root), "--remote", s3_root, *options)
    assert {r["name"]: r["tiers"] for r in rows}["step_000000004"] == ["local", "remote"]
    there = _json(capsys, "show", s3_root, "latest", *options)
    assert there["digest"] == _json(capsys, "show", str(root), "step_000000004")["digest"]


def test_replicate_refuses_a_dest_holding_the_name_with_another_checkpoint(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "second"
    writer = SafeStorageWriter(dest, step=4, options=WriterOptions(fsync=False))
    dcp_safe.save(_state(40), checkpoint_id="step_000000004", storage_writer=writer)
    status, out, _ = _run(capsys, "replicate", str(root), "step_000000004", str(dest), "--json")
    assert status == EXIT_EXISTS
    _conform(json.loads(out), SCHEMAS["error"])
    assert json.loads(out)["error"] == "CheckpointExistsError"
    loaded = {"w": torch.zeros(4, 4)}
    dcp_safe.load(
        loaded, checkpoint_id="step_000000004", storage_reader=dcp_safe.SafeStorageReader(dest)
    )
    assert torch.equal(loaded["w"], torch.full((4, 4), 40.0))  # untouched


def test_replicate_of_a_corrupt_source_commits_nothing(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (shard,) = sorted((root / "step_000000002").glob(f"*{layout.SHARD_SUFFIX}"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    dest = tmp_path / "second"
    status, _, err = _run(capsys, "replicate", str(root), "step_000000002", str(dest))
    assert status == EXIT_FAILED and "CORRUPT" in err
    assert not dest.exists() or dcp_safe.list_checkpoints(dest) == []


def test_adopt_json_commits_a_stock_checkpoint_that_then_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    stock = tmp_path / "old" / "step_7"
    dcp.save({"w": torch.ones(3), "step": 7}, storage_writer=dcp.FileSystemWriter(str(stock)))
    doc = _json(capsys, "adopt", str(stock), str(tmp_path / "new"))
    assert (doc["name"], doc["copied"], doc["world_size"], doc["items"]) == ("step_7", True, 1, 2)
    assert doc["unchecked"] and "no checksums" in doc["unchecked"][0]
    assert [c["name"] for c in _json(capsys, "ls", str(tmp_path / "new"))] == ["step_7"]
    status, out, _ = _run(capsys, "adopt", str(stock), str(tmp_path / "new"), "--json")
    assert status == EXIT_EXISTS and json.loads(out)["exit_code"] == EXIT_EXISTS
    status, _, err = _run(capsys, "adopt", str(tmp_path / "nothing"), str(tmp_path / "new"))
    assert status == EXIT_NOT_FOUND and "stock DCP checkpoint to adopt" in err


# ------------------------------------------------------------------------- errors and exit codes


@pytest.mark.parametrize(
    ("argv", "code", "kind"),
    [
        (["ls", "{root}/nope"], EXIT_NOT_FOUND, "FileNotFoundError"),
        (["show", "{root}", "step_9"], EXIT_NOT_FOUND, "CheckpointNotFoundError"),
        (["diff", "{root}", "step_000000002", "step_9"], EXIT_NOT_FOUND, "CheckpointNotFoundError"),
        (["gc", "{root}", "--keep", "0"], EXIT_USAGE, "UsageError"),
        (["history"], EXIT_USAGE, "UsageError"),
        (["show", "{root}", "../up"], EXIT_USAGE, "InvalidCheckpointNameError"),
    ],
)
def test_errors_with_json_are_one_document_with_the_exit_code(
    root: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    kind: str,
) -> None:
    status, out, err = _run(capsys, *(a.format(root=root) for a in argv), "--json")
    assert status == code, err
    doc = json.loads(out)
    _conform(doc, SCHEMAS["error"])
    assert (doc["error"], doc["exit_code"]) == (kind, code)
    assert err == ""


def test_a_damaged_checkpoint_with_json_exits_one(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (shard,) = sorted((root / "step_000000004").glob(f"*{layout.SHARD_SUFFIX}"))
    shard.write_bytes(shard.read_bytes()[:-1])
    status, out, _ = _run(capsys, "verify", str(root), "step_000000004", "--json")
    assert status == EXIT_FAILED
    doc = json.loads(out)
    assert doc["error"] == "CheckpointCorruptError" and doc["message"].startswith("CORRUPT: ")


@pytest.mark.parametrize(
    ("options", "words"),
    [(["--dtype", "int8"], "floating"), (["--keys", "nope"], "keys not in the checkpoint")],
)
def test_unrelated_export_errors_carry_their_own_hint_not_ls(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], words: str
) -> None:
    dest = tmp_path / "out"
    status, _, err = _run(capsys, "export", str(root), "latest", str(dest), *options)
    assert status == EXIT_USAGE and words in err and "dcp-safe ls" not in err
    dest.mkdir()
    status, _, err = _run(capsys, "export", str(root), "latest", str(dest))
    assert status == EXIT_USAGE and "--overwrite" in err and "dcp-safe ls" not in err


def test_help_prints_the_exit_code_table(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["show", "--help"], ["export", "--help"]):
        assert main(argv) == EXIT_OK
        out = capsys.readouterr().out
        for code, name, _ in EXIT_CODES:
            assert f"  {code}  {name}" in out, (argv, name)


def test_the_exit_code_table_is_in_the_docs() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
    for code, name, _ in EXIT_CODES:
        assert f"| {code} | `{name}` |" in page, name
    for command, schema in SCHEMAS.items():
        assert f"```json\n{json.dumps(schema, indent=2)}\n```" in page, command


# ------------------------------------------------------------------------- startup without torch

# Runs the CLI, then says on stderr's last line whether torch was imported.
_WATCH = (
    "import sys\n"
    "from dcp_safe.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
    "sys.exit(status)\n"
)


def _watched(*argv: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _WATCH, *argv],
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stderr.strip().splitlines()[-1]


@pytest.mark.subprocess
def test_ls_history_show_and_the_manifest_verbs_do_not_import_torch(root: Path) -> None:
    for argv in (
        ["ls", str(root)],
        ["ls", str(root), "--json"],
        ["history", str(root), "--json"],
        ["show", str(root), "signed", "--json"],
        ["diff", str(root), "step_000000002", "step_000000004"],
        ["verify", str(root), "--quick"],
        ["gc", str(root), "--keep", "3", "--dry-run"],
        ["replicate", str(root), "latest", str(root.parent / "second"), "--json"],
    ):
        assert _watched(*argv) == (EXIT_OK, "no torch"), argv
    # The check can tell: a verb that decodes tensors imports it.
    assert _watched("inspect", str(root), "latest", "--json") == (EXIT_OK, "torch imported")


@pytest.mark.subprocess
def test_importtime_of_ls_shows_no_torch(root: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dcp_safe.cli", "ls", str(root)],
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    modules = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "dcp_safe.cli_output" in modules and "rich.table" in modules
    assert [m for m in modules if m == "torch" or m.startswith("torch.")] == []
