"""What two back-to-back async saves leave on disk, for each staging path of the sweep.

Usage::

    .venv/bin/python benchmarks/check_back_to_back.py [--size-mib 512]

The sweep's *pair* measures two save requests issued back to back (the second as soon as the
first one's stall ends). A stager that reuses one cached copy can make the second request
cheap by restaging into buffers the first upload is still reading. This check makes that
visible: the state is all 1.0 at the first request, 2.0 at the second, 3.0 afterwards; the
first checkpoint must load as all 1.0. Exit status 0 when every contender that ran kept its
first checkpoint intact, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.bench.savers import DcpSafeSaver, Saver, TorchSaver, TorchStaging

Reader = Callable[[Path, str], tuple[Any, str | None]]

CONTENDERS: dict[str, tuple[Callable[[Path], Saver], Reader]] = {
    "dcp_safe": (DcpSafeSaver, lambda w, n: (SafeStorageReader(w), n)),
    "torch_default_async": (TorchSaver, lambda w, n: (FileSystemReader(w / n), None)),
    "torch_default_stager": (
        lambda w: TorchSaver(w, staging=TorchStaging.DEFAULT_STAGER),
        lambda w, n: (FileSystemReader(w / n), None),
    ),
}


def first_checkpoint_values(make: Callable[[Path], Saver], reader: Reader, size: int) -> set[float]:
    """The distinct values the first of two back-to-back checkpoints loads as."""
    work = Path(tempfile.mkdtemp(prefix="back_to_back_"))
    saver = make(work)
    try:
        state = {f"t{i}": torch.full((size // 8 // 4,), 1.0) for i in range(8)}
        first = saver.call(state, "a", saver.writer_for("a"))
        if first.staged is not None:
            first.staged.result()
        for tensor in state.values():  # the training loop moves on
            tensor.fill_(2.0)
        second = saver.call(state, "b", saver.writer_for("b"))
        if second.staged is not None:
            second.staged.result()
        for tensor in state.values():
            tensor.fill_(3.0)
        first.upload.result(timeout=600)
        second.upload.result(timeout=600)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        storage_reader, checkpoint_id = reader(work, "a")
        load(target, checkpoint_id=checkpoint_id, storage_reader=storage_reader, no_dist=True)
        return {float(x) for t in target.values() for x in t.unique().tolist()}
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    intact = True
    for name, (make, reader) in CONTENDERS.items():
        values = first_checkpoint_values(make, reader, args.size_mib << 20)
        ok = values == {1.0}
        intact &= ok
        verdict = "intact" if ok else "OVERWRITTEN by the second save's state"
        print(f"{name:22s} first checkpoint loads as {sorted(values)}: {verdict}")
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
