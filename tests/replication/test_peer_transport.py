"""Files between two gloo ranks (the peer tier's transport): checked as they land, and in step.

Rank 0 sends four files in a row to rank 1, in chunks smaller than a file: one whole, one it
cannot read (missing), one whose bytes differ from the manifest's checksum, one whole again.
Rank 1 lands the good ones, rejects the others with typed errors and leaves nothing of them,
and still lands the last file: a failure on either end never puts the two out of step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from dcp_safe import CheckpointCorruptError
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.manifest.checksum import digest_bytes
from dcp_safe.manifest.schema import FileRecord
from dcp_safe.replication.peer_transport import SenderFailedError, receive_file, send_file
from dcp_safe.testing.multiproc import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

CHUNK = 1000
FILES = {"a.bin": b"a" * 2500, "missing.bin": b"m" * 1500, "flipped.bin": b"f" * 3000}
FILES["last.bin"] = bytes(range(256)) * 9


def _record(name: str) -> FileRecord:
    data = FILES[name]
    return FileRecord(path=name, size=len(data), checksum=digest_bytes(data, "xxh3_128"))


def _exchange(rank: int, world_size: int, folders: list[str]) -> dict[str, str]:
    backend = LocalBackend(folders[rank])
    outcomes: dict[str, str] = {}
    for tag, name in enumerate(FILES):
        record = _record(name)
        if rank == 0:
            error = send_file(
                dist.group.WORLD, 1, backend, name, record.size, tag=tag, chunk_bytes=CHUNK
            )
            outcomes[name] = error or "sent"
            continue
        try:
            receive_file(
                dist.group.WORLD, 0, backend, f"in/{name}", record, [], tag=tag, chunk_bytes=CHUNK
            )
        except SenderFailedError:
            outcomes[name] = "sender failed"
        except CheckpointCorruptError as exc:
            outcomes[name] = f"corrupt: {exc}"
        else:
            outcomes[name] = "landed"
    return outcomes


def test_a_failed_file_is_rejected_and_the_next_one_still_lands(tmp_path: Path) -> None:
    sender, receiver = tmp_path / "sender", tmp_path / "receiver"
    sender.mkdir()
    (receiver / "in").mkdir(parents=True)
    for name, data in FILES.items():
        if name == "flipped.bin":
            data = data[:-1] + b"X"
        if name != "missing.bin":
            (sender / name).write_bytes(data)
    sent, received = run_ranks(_exchange, 2, args=([str(sender), str(receiver)],))

    assert sent["a.bin"] == sent["flipped.bin"] == sent["last.bin"] == "sent"
    assert "missing.bin" in sent["missing.bin"] or "FileNotFound" in sent["missing.bin"]
    assert received["a.bin"] == received["last.bin"] == "landed"
    assert received["missing.bin"] == "sender failed"
    assert received["flipped.bin"].startswith("corrupt:") and "checksum" in received["flipped.bin"]
    assert sorted(p.name for p in (receiver / "in").iterdir()) == ["a.bin", "last.bin"]
    assert (receiver / "in" / "last.bin").read_bytes() == FILES["last.bin"]
