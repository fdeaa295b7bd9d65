"""The fsync tail of a local commit: control files one after another vs at once.

Usage::

    .venv/bin/python benchmarks/bench_commit_tail.py --rounds 20

What a local publish does after verification, on a real partial directory holding one shard
and one rank manifest (written and fsynced beforehand, untimed), timed two ways in one process
with the order alternating every round:

* ``serial``: the sequence before #18 — write+fsync ``.metadata``, ``manifest.json``, fsync
  ``_ranks/``, write+fsync ``_COMMITTED``, fsync the partial directory, rename, fsync the root;
* ``batched``: ``RenameStrategy.publish`` with the control files — the three writes (each with
  its fsync) and the ``_ranks/`` fsync at once, then the directory's fsync, rename, root fsync.

Both make every byte and entry durable before the rename and the rename durable before
returning; only the overlap differs. Medians and the ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_safe import layout
from dcp_safe.backends.local_backend import LocalBackend
from dcp_safe.commit.strategy import RenameStrategy

METADATA = os.urandom(40_000)
MANIFEST = os.urandom(3_000)
MARKER = b"sha256:" + b"0" * 64


def _prepare(backend: LocalBackend, name: str) -> str:
    work = layout.partial_dir_name(name, layout.new_save_id())
    backend.makedirs(f"{work}/{layout.RANKS_DIR}")
    backend.write_bytes(f"{work}/{layout.shard_file_name(0, 0)}", os.urandom(1 << 20))
    backend.write_bytes(f"{work}/{layout.rank_manifest_name(0)}", os.urandom(2_000))
    return work


def serial(backend: LocalBackend, work: str, name: str) -> None:
    backend.write_bytes(f"{work}/{layout.DCP_METADATA}", METADATA)
    backend.write_bytes(f"{work}/{layout.MANIFEST}", MANIFEST)
    backend.sync_dir(f"{work}/{layout.RANKS_DIR}")
    backend.write_bytes(f"{work}/{layout.COMMITTED_MARKER}", MARKER, exclusive=True)
    backend.sync_dir(work)
    backend.publish_dir(work, name, replace=False)
    backend.sync_dir("")


def batched(backend: LocalBackend, work: str, name: str) -> None:
    RenameStrategy().publish(
        backend,
        work,
        name,
        MARKER,
        files={layout.DCP_METADATA: METADATA, layout.MANIFEST: MANIFEST},
        sync_dirs=(layout.RANKS_DIR,),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dir", default=None, help="parent of the scratch root (default: tmp)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-commit-tail-", dir=args.dir)
    backend = LocalBackend(root)
    contenders: dict[str, Callable[[LocalBackend, str, str], None]] = {
        "serial": serial,
        "batched": batched,
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    try:
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for label in order:
                name = f"{label}_{r}"
                work = _prepare(backend, name)
                start = time.perf_counter()
                contenders[label](backend, work, name)
                times[label].append(time.perf_counter() - start)
                backend.remove_tree(name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for label, samples in times.items():
        print(
            f"{label:8s} median {1000 * statistics.median(samples):7.2f} ms"
            f"  min {1000 * min(samples):7.2f} ms  ({len(samples)} rounds)"
        )
    ratio = statistics.median(times["batched"]) / statistics.median(times["serial"])
    print(f"batched / serial (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
