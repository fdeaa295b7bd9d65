"""``dcp-safe export``: the verb against real checkpoints, its outputs loaded by their libraries.

Most cases call ``main([...])`` in-process (output through pytest's capture); one runs the
installed ``dcp-safe`` executable as a real subprocess. Option errors are one line on stderr
and exit status 2; a corrupt checkpoint is exit status 1 with nothing left at DEST.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dcp_safe
from dcp_safe import SafeStorageWriter, WriterOptions, layout
from dcp_safe.cli import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, main

pytestmark = pytest.mark.subprocess

# Generous: only a guard against a hung subprocess, never a measure of speed.
_SUBPROCESS_TIMEOUT_S = 300


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "model.proj.weight": torch.randn(32, 16, generator=gen),
        "model.proj.bias": torch.randn(32, generator=gen),
        "model.ids": torch.arange(10),
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    weights = _weights()
    state = {
        "model": {
            "proj": {"weight": weights["model.proj.weight"], "bias": weights["model.proj.bias"]},
            "ids": weights["model.ids"],
        },
        "meta": {"epoch": 2},
    }
    writer = SafeStorageWriter(path, options=WriterOptions(fsync=False), step=1)
    dcp_safe.save(state, checkpoint_id="step_0001", storage_writer=writer)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _one_line_error(err: str) -> None:
    assert err.startswith("dcp-safe: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_export_writes_safetensors_and_says_what_it_skipped(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    status, out, err = _run(capsys, "export", str(root), "latest", str(dest))
    assert status == EXIT_OK, err
    assert "exported step_0001" in out and "skipped meta.epoch" in out
    loaded = load_file(dest / "model.safetensors")
    assert sorted(loaded) == sorted(_weights())
    assert all(torch.equal(loaded[k], v) for k, v in _weights().items())


def test_export_torch_with_keys_and_a_dtype(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    status, _, err = _run(
        capsys,
        "export",
        str(root),
        "step_0001",
        str(dest),
        "--format",
        "torch",
        "--keys",
        "model.proj",
        "meta",
        "--dtype",
        "bfloat16",
    )
    assert status == EXIT_OK, err
    loaded = torch.load(dest / "model.pt", weights_only=True)
    assert loaded["meta.epoch"] == 2
    assert sorted(loaded) == ["meta.epoch", "model.proj.bias", "model.proj.weight"]
    for key in ("model.proj.bias", "model.proj.weight"):
        assert torch.equal(loaded[key], _weights()[key].to(torch.bfloat16)), key


def test_export_sharded_by_max_shard_bytes(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    args = ("export", str(root), "latest", str(dest), "--max-shard-bytes", "1")
    status, _, err = _run(capsys, *args)
    assert status == EXIT_OK, err
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(_weights())
    assert len(set(index["weight_map"].values())) == 3


def test_an_existing_dest_is_a_usage_error_until_overwrite(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    assert _run(capsys, "export", str(root), "latest", str(dest))[0] == EXIT_OK
    status, _, err = _run(capsys, "export", str(root), "latest", str(dest), "--format", "torch")
    assert status == EXIT_USAGE
    _one_line_error(err)
    assert "exists" in err and "--overwrite" in err
    args = ("export", str(root), "latest", str(dest), "--format", "torch", "--overwrite")
    assert _run(capsys, *args)[0] == EXIT_OK
    assert sorted(p.name for p in dest.iterdir()) == ["SHA256SUMS", "model.pt"]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--keys", "model.nope"], "keys not in the checkpoint"),
        (["--dtype", "int8"], "floating"),
        (["--max-shard-bytes", "0"], "max_shard_bytes"),
    ],
)
def test_bad_options_are_one_line_usage_errors(
    root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    words: str,
) -> None:
    dest = tmp_path / "out"
    status, _, err = _run(capsys, "export", str(root), "latest", str(dest), *options)
    assert status == EXIT_USAGE
    _one_line_error(err)
    assert words in err
    assert not dest.exists()


def test_a_missing_root_or_checkpoint_is_not_found(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(capsys, "export", str(tmp_path / "nope"), "latest", str(tmp_path / "o"))
    assert status == EXIT_NOT_FOUND and "no such directory" in err
    status, _, err = _run(capsys, "export", str(root), "step_0404", str(tmp_path / "o"))
    assert status == EXIT_NOT_FOUND
    _one_line_error(err)


def test_the_installed_command_fails_on_a_corrupt_shard_and_leaves_nothing(
    root: Path, tmp_path: Path
) -> None:
    (shard,) = sorted((root / "step_0001").glob(f"*{layout.SHARD_SUFFIX}"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    dest = tmp_path / "out"
    exe = Path(sys.executable).with_name("dcp-safe")
    done = subprocess.run(
        [str(exe), "export", str(root), "latest", str(dest)],
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == EXIT_FAILED, done.stderr
    assert done.stderr.startswith("dcp-safe: error: CORRUPT") and "Traceback" not in done.stderr
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if ".export-" in p.name] == []
