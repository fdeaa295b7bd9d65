"""``dcp-safe``: every subcommand against real checkpoints, on a local root and on moto S3.

Most cases call ``main([...])`` in-process (output through pytest's capture); one runs the
installed ``dcp-safe`` executable as a real subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_state, resign_manifest
from support.faults import DiesInWriteData, Planted, abandon_a_save

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.checkpoints.committed import open_committed
from dcp_safe.cli import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, main
from dcp_safe.cli_output import EXIT_ERROR
from dcp_safe.testing.s3 import LocalS3
from dcp_safe.topology import Root

# Generous: only a guard against a hung subprocess, never a measure of speed.
_SUBPROCESS_TIMEOUT_S = 300


def _save(
    root: str | Path, step: int, signing_key: str | None = None, **kwargs: Any
) -> SafeStorageWriter:
    options = WriterOptions(fsync=False, signing_key=signing_key)  # type: ignore[arg-type]
    writer = SafeStorageWriter(root, step=step, options=options, **kwargs)
    dcp_safe.save(make_state(step), checkpoint_id=f"step_{step:04d}", storage_writer=writer)
    return writer


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _shard(root: Path, name: str) -> Path:
    (shard,) = sorted((root / name).glob(f"*{layout.SHARD_SUFFIX}"))
    return shard


@dataclass(frozen=True)
class _Remote:
    """A fresh root on the session's moto S3, and the CLI's --storage-options for it."""

    server: LocalS3
    bucket: str
    root: str
    options: dict[str, Any]

    @property
    def cli_options(self) -> list[str]:
        return ["--storage-options", json.dumps(self.options)]


@pytest.fixture
def remote(
    s3: LocalS3,
    s3_bucket: str,
    s3_root: str,
    s3_options: dict[str, Any],
) -> _Remote:
    return _Remote(server=s3, bucket=s3_bucket, root=s3_root, options=s3_options)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A local root holding step_0001..step_0003, committed."""
    path = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(path, step)
    return path


# ------------------------------------------------------------------------------------ ls


def test_ls_json_lists_committed_checkpoints_with_step_size_and_world_size(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "ls", str(root), "--json")
    assert status == EXIT_OK
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["step_0001", "step_0002", "step_0003"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    infos = dcp_safe.list_checkpoints(root)
    assert [r["size_bytes"] for r in rows] == [i.size_bytes for i in infos]
    assert all(r["world_size"] == 1 and r["tiers"] == ["local"] for r in rows)


def test_ls_table_leaves_out_an_abandoned_partial_save(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(dcp_safe.CommitError):
        dcp_safe.save(
            make_state(9), checkpoint_id="step_0009", storage_writer=DiesInWriteData(root)
        )
    status, out, _ = _run(capsys, "ls", str(root))
    assert status == EXIT_OK
    assert "step_0003" in out and "step_0001" in out
    assert "step_0009" not in out


def test_ls_of_a_missing_root_is_not_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(capsys, "ls", str(tmp_path / "nope"))
    assert status == EXIT_NOT_FOUND
    assert "no such directory" in err and "Traceback" not in err


@pytest.mark.s3
def test_ls_with_remote_shows_the_tiers_each_checkpoint_is_committed_on(
    root: Path, remote: _Remote, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = _save(root, 4, replicate_to=Root(remote.root, storage_options=remote.options))
    writer.replication("step_0004").result(timeout=_SUBPROCESS_TIMEOUT_S)
    writer.close()
    status, out, _ = _run(
        capsys, "ls", str(root), "--remote", remote.root, *remote.cli_options, "--json"
    )
    assert status == EXIT_OK
    tiers = {r["name"]: r["tiers"] for r in json.loads(out)}
    assert tiers == {
        "step_0001": ["local"],
        "step_0002": ["local"],
        "step_0003": ["local"],
        "step_0004": ["local", "remote"],
    }


@pytest.mark.s3
def test_missing_credentials_are_one_line_with_a_hint_not_a_traceback(
    remote: _Remote, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_keys = {"endpoint_url": remote.options["endpoint_url"], "anon": False}
    status, _, err = _run(capsys, "ls", remote.root, "--storage-options", json.dumps(no_keys))
    assert status == EXIT_ERROR  # not damage: the storage could not be reached
    assert "credentials" in err and "Traceback" not in err


# -------------------------------------------------------------------------------- verify


@pytest.mark.parametrize("flags", [[], ["--quick"], ["--deep"]])
def test_verify_sound_checkpoint_exits_zero(
    root: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    status, out, _ = _run(capsys, "verify", str(root), "latest", *flags)
    assert status == EXIT_OK
    assert "OK step_0003" in out
    how = "marker, manifest and file sizes" if flags == ["--quick"] else "every byte matches"
    assert how in out  # the default reads every byte, as verify_checkpoint() does


def test_verify_deep_names_the_file_and_item_of_a_flipped_byte(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = _shard(root, "step_0002")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    # Sizes still match: the quick check passes, reading every byte does not.
    assert _run(capsys, "verify", str(root), "step_0002", "--quick")[0] == EXIT_OK
    status, _, err = _run(capsys, "verify", str(root), "step_0002")
    assert status == EXIT_FAILED
    assert "CORRUPT" in err and shard.name in err and "item" in err
    assert "Traceback" not in err


def test_verify_refuses_an_object_item_a_load_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its checksum matches (the writer computed it), so only the restricted check tells."""
    sentinel = tmp_path / "code-ran"
    state = make_state(1)
    state["extra"]["tag"] = Planted(sentinel)
    root = tmp_path / "ckpt"
    dcp_safe.save(
        state,
        checkpoint_id="step_0001",
        storage_writer=SafeStorageWriter(root, options=WriterOptions(fsync=False)),
    )
    status, _, err = _run(capsys, "verify", str(root), "step_0001")
    assert status == EXIT_FAILED and "object is not plain data" in err and "extra" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(dcp_safe.errors.UnsafeCheckpointError):
        dcp_safe.verify_checkpoint(root, "step_0001")
    assert _run(capsys, "verify", str(root), "step_0001", "--quick")[0] == EXIT_OK
    status, out, _ = _run(capsys, "verify", str(root), "step_0001", "--allow-pickle")
    assert status == EXIT_OK and "--allow-pickle" in out
    assert not sentinel.exists()  # verification never runs it, whatever the flags


def test_verify_counts_the_object_items_it_checked(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = dcp_safe.verify_checkpoint(root, "step_0001")
    assert report.objects_checked >= 3  # extra.epoch, extra.history..., extra.tag
    status, out, _ = _run(capsys, "verify", str(root), "step_0001")
    assert status == EXIT_OK and f"{report.objects_checked} object item(s) load safely" in out


def test_verify_quick_catches_a_truncated_shard(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = _shard(root, "step_0001")
    shard.write_bytes(shard.read_bytes()[:-10])
    status, _, err = _run(capsys, "verify", str(root), "step_0001", "--quick")
    assert status == EXIT_FAILED
    assert shard.name in err and "size" in err


@pytest.mark.parametrize(
    ("argv", "says", "code"),
    [
        (["verify", "{root}", "step_0042"], "dcp-safe ls", EXIT_NOT_FOUND),
        (["verify", "{root}", "../escape"], "invalid checkpoint name", EXIT_USAGE),
        (["verify", "{root}/missing"], "no such directory", EXIT_NOT_FOUND),
        (["verify"], "required", EXIT_USAGE),
        (["verify", "{root}", "--storage-options", "{{not json"], "not valid JSON", EXIT_USAGE),
        (["verify", "{root}", "--storage-options", "[1]"], "JSON object", EXIT_USAGE),
    ],
)
def test_verify_usage_and_lookup_errors_exit_with_their_code_and_say_what_to_do(
    root: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str, code: int
) -> None:
    status, _, err = _run(capsys, *(a.format(root=root) for a in argv))
    assert status == code
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        # Each of these once ended in a traceback, or in several lines, or in exit status 1.
        ["ls", "nosuchproto://bucket/run"],
        ["ls", "{root}", "--remote", "nosuchproto://bucket/run"],
        ["ls", "s3://bucket/run", "--storage-options", '{{"no_such_option": 1}}'],
        ["verify", "{root}", "--signing-key-file", "{root}/no-such-key"],
        ["verify", "{root}", "--signing-key-file", "{root}"],
        ["export", "{root}", "step_0002"],
        ["gc", "{root}", "--keep", "two"],
        ["gc", "{root}", "--keep", "1", "--grace-s", "nan"],
        ["inspect", "{root}", "step_0002", "--no-such-flag"],
        # Round 3 (issue 43): a URL with no bucket; an option of the wrong type for s3fs.
        ["ls", "s3://"],
        ["gc", "s3://", "--keep", "1"],
        ["ls", "{root}", "--remote", "s3:///"],
        ["verify", "s3://bucket/run", "--storage-options", '{{"client_kwargs": 5}}'],
        [
            "ls",
            "{root}",
            "--remote",
            "s3://bucket/run",
            "--storage-options",
            '{{"config_kwargs": 5}}',
        ],
        ["no-such-command"],
        ["bench", "--no-such-flag"],
    ],
)
def test_every_option_error_is_one_line_and_exit_two(
    root: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    status, _, err = _run(capsys, *(a.format(root=root) for a in argv))
    assert status == EXIT_USAGE
    assert len(err.strip().splitlines()) == 1 and err.startswith("dcp-safe: error: "), err
    assert "Traceback" not in err


def test_verify_of_an_empty_root_says_nothing_is_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(capsys, "verify", str(tmp_path))
    assert status == EXIT_NOT_FOUND
    assert "no committed checkpoint" in err


@pytest.mark.s3
def test_verify_deep_on_s3_passes_then_fails_after_an_object_is_overwritten(
    remote: _Remote, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(remote.root, 5, storage_options=remote.options)
    status, out, _ = _run(capsys, "verify", remote.root, "--deep", *remote.cli_options)
    assert status == EXIT_OK and "OK step_0005" in out
    prefix = remote.root.removeprefix(f"s3://{remote.bucket}/")
    keys = remote.server.keys(remote.bucket, prefix)
    (key,) = [k for k in keys if k.endswith(layout.SHARD_SUFFIX)]
    client = remote.server.client()
    body = bytearray(client.get_object(Bucket=remote.bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01
    client.put_object(Bucket=remote.bucket, Key=key, Body=bytes(body))
    status, _, err = _run(capsys, "verify", remote.root, "step_0005", "--deep", *remote.cli_options)
    assert status == EXIT_FAILED and "CORRUPT" in err and key.rsplit("/", 1)[-1] in err


# ------------------------------------------------------------------------------- inspect


def test_inspect_json_reports_every_tensor_and_the_totals(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "inspect", str(root), "step_0002", "--json")
    assert status == EXIT_OK
    report = json.loads(out)
    entries = {e["fqn"]: e for e in report["entries"]}
    state = make_state(2)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for fqn, tensor in tensors.items():
        entry = entries[fqn]
        assert entry["shape"] == list(tensor.shape), fqn
        assert entry["dtype"] == str(tensor.dtype).removeprefix("torch."), fqn
        assert entry["bytes"] == tensor.numel() * tensor.element_size(), fqn
        assert entry["shards"] == 1
    assert entries["extra.epoch"]["kind"] == "object"
    assert report["totals"]["tensors"] == len(tensors)
    assert report["totals"]["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    manifest = open_committed(open_backend(str(root)), "step_0002").manifest
    stored = sum(item.length for item in manifest.items)
    assert report["totals"]["stored_bytes"] == stored


def test_inspect_table_shows_shapes_and_dtypes(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "inspect", str(root), "latest")
    assert status == EXIT_OK
    assert "step_0003" in out and "bfloat16" in out and "16x8" in out and "tensors" in out


@pytest.mark.s3
def test_inspect_reads_a_checkpoint_on_s3(
    remote: _Remote, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(remote.root, 6, storage_options=remote.options)
    status, out, _ = _run(
        capsys, "inspect", remote.root, "step_0006", "--json", *remote.cli_options
    )
    assert status == EXIT_OK
    assert {e["fqn"] for e in json.loads(out)["entries"]} >= {"f32", "bf16", "i64"}


def test_inspect_unknown_checkpoint_is_not_found(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(capsys, "inspect", str(root), "step_0099")
    assert status == EXIT_NOT_FOUND and "step_0099" in err


# ------------------------------------------------------------------------------------ gc


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for folder, _, files in os.walk(path):
        for name in files:
            os.utime(os.path.join(folder, name), (then, then))
        os.utime(folder, (then, then))


def test_gc_dry_run_says_what_it_would_remove_and_removes_nothing(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(root, 4)
    old = abandon_a_save(root, "step_0008", seed=8)
    _age(root / old, 3600)
    before = sorted(os.listdir(root))
    status, out, _ = _run(capsys, "gc", str(root), "--keep", "2", "--dry-run", "--grace-s", "60")
    assert status == EXIT_OK
    assert "would remove checkpoint step_0001" in out
    assert "would remove checkpoint step_0002" in out
    assert f"would remove abandoned partial save {old}" in out
    assert sorted(os.listdir(root)) == before


def test_gc_applies_retention_and_collects_only_old_partials(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(root, 4)
    old = abandon_a_save(root, "step_0008", seed=8)
    _age(root / old, 3600)
    recent = abandon_a_save(root, "step_0009", seed=9)
    status, out, _ = _run(capsys, "gc", str(root), "--keep", "2", "--grace-s", "60")
    assert status == EXIT_OK
    assert [i.name for i in dcp_safe.list_checkpoints(root)] == ["step_0003", "step_0004"]
    assert not (root / old).exists() and (root / recent).exists()
    assert f"removed abandoned partial save {old}" in out
    assert f"kept partial save {recent}" in out


@pytest.mark.s3
def test_gc_on_s3_keeps_the_newest(remote: _Remote, capsys: pytest.CaptureFixture[str]) -> None:
    for step in (1, 2, 3):
        _save(remote.root, step, storage_options=remote.options)
    status, out, _ = _run(capsys, "gc", remote.root, "--keep", "2", *remote.cli_options)
    assert status == EXIT_OK and "removed checkpoint step_0001" in out
    infos = dcp_safe.list_checkpoints(remote.root, storage_options=remote.options)
    assert [i.name for i in infos] == ["step_0002", "step_0003"]


def test_gc_warns_about_a_damaged_entry_in_the_cli_form(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every line the CLI prints on stderr starts with ``dcp-safe:``, library warnings too."""
    resign_manifest(root, "step_0002", lambda raw: raw.update(created_at="yesterday"))
    status, out, err = _run(capsys, "gc", str(root), "--keep", "5", "--dry-run")
    assert status == EXIT_OK and "kept 2 checkpoint(s)" in out
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("dcp-safe: warning: ") for line in lines), lines
    assert any("step_0002" in line for line in lines)


def test_gc_with_a_key_file_keeps_the_signed_checkpoints_past_planted_unsigned_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DCP_SAFE_SIGNING_KEY", raising=False)
    key_file, root = tmp_path / "key", tmp_path / "ckpt"
    key_file.write_text("hex:" + "5a" * 32 + "\n")
    for step in (1, 2, 3):
        _save(root, step, signing_key=key_file.read_text().strip())
    for step in (8, 9):  # planted by a writer of the root without the key
        _save(root, step)
    status, out, _ = _run(
        capsys, "gc", str(root), "--keep", "2", "--signing-key-file", str(key_file)
    )
    assert status == EXIT_OK and "removed checkpoint step_0001" in out
    assert "not counted, left in place: step_0009" in out
    names = [i.name for i in dcp_safe.list_checkpoints(root)]
    assert names == ["step_0002", "step_0003", "step_0008", "step_0009"]


def test_gc_keep_below_one_is_a_usage_error(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _run(capsys, "gc", str(root), "--keep", "0")
    assert status == EXIT_USAGE and "--keep" in err
    assert len(dcp_safe.list_checkpoints(root)) == 3


# --------------------------------------------------------------------------------- bench


def test_bench_passes_its_arguments_to_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "bench", "--help")
    assert status == EXIT_OK
    assert "usage" in out.lower()
    status, _, err = _run(capsys, "bench", "--no-such-option")
    assert status == EXIT_USAGE and "--no-such-option" in err


# ---------------------------------------------------------------------------- subprocess


@pytest.mark.subprocess
def test_installed_executable_reports_corruption_with_exit_one_and_no_traceback(
    root: Path,
) -> None:
    shard = _shard(root, "step_0003")
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    exe = Path(sys.executable).with_name("dcp-safe")
    done = subprocess.run(
        [str(exe), "verify", str(root), "--deep"],
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == EXIT_FAILED, done.stderr
    assert done.stderr.startswith("dcp-safe: error: CORRUPT")
    assert shard.name in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------- the newest name present


@pytest.mark.subprocess
def test_verify_fails_and_inspect_and_export_warn_when_the_newest_manifest_is_truncated(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated newest manifest: verify no longer checks the older one and says OK; inspect
    and export name the checkpoint they used and the damaged newer one they passed over."""
    manifest = root / "step_0003" / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:100])

    status, out, err = _run(capsys, "verify", str(root))
    assert status == EXIT_FAILED and "OK" not in out
    assert "step_0003, the newest checkpoint present, is damaged" in err
    assert _run(capsys, "verify", str(root), "step_0002")[0] == EXIT_OK  # by name: as before

    status, out, err = _run(capsys, "inspect", str(root), "latest", "--json")
    assert status == EXIT_OK and json.loads(out)["name"] == "step_0002"
    assert "using step_0002, not step_0003, which may be newer but is damaged" in err

    status, out, err = _run(capsys, "export", str(root), "latest", str(tmp_path / "out"))
    assert status == EXIT_OK and out.startswith("exported step_0002 ")
    assert "using step_0002, not step_0003" in err


@pytest.mark.subprocess
def test_a_damaged_entry_older_than_the_newest_sound_one_does_not_fail_verify(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = root / "step_0001" / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:100])

    status, out, _ = _run(capsys, "verify", str(root))
    assert status == EXIT_OK and "OK step_0003" in out


@pytest.mark.subprocess
def test_ls_prints_markup_and_controls_in_roots_and_names_literally(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A root spelled with rich markup (``[red]``, an unmatched ``[/y]``) and a committed name
    with a control character (``step_0002\\n``, which the name rule's ``$`` let through): was a
    root shown without its ``[red]``, a ``MarkupError`` traceback, and a table row broken in
    two. The name rule now refuses it: it is no checkpoint, and breaks no row."""
    root = tmp_path / "ru[red]n[/y]"
    _save(root, 1)
    _save(root, 2)
    (root / "step_0002").rename(root / "step_0002\n")
    resign_manifest(root, "step_0002\n", lambda raw: raw.update(name="step_0002\n"))
    status, out, err = _run(capsys, "ls", str(root))
    assert status == EXIT_OK and "Traceback" not in err, err
    assert "ru[red]n[/y]" in out
    assert "step_0002\n" not in out
    rows = [line for line in out.splitlines() if "step_000" in line]
    assert len(rows) == 1 and "step_0001" in rows[0]


@pytest.mark.subprocess
def test_inspect_prints_keys_and_roots_with_markup_literally(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keys are any strings (``w[/b]`` is a fine one): was a ``MarkupError`` traceback, and
    ``[red]k`` shown as ``k``."""
    root = tmp_path / "r[/y]"
    state = {"w[/b]": torch.ones(2), "[red]k": torch.ones(1)}
    dcp_safe.save(state, checkpoint_id="step_0001", storage_writer=SafeStorageWriter(root))
    status, out, err = _run(capsys, "inspect", str(root), "step_0001")
    assert status == EXIT_OK and "Traceback" not in err, err
    assert "w[/b]" in out and "[red]k" in out and "r[/y]" in out
