"""Floors: what the hardware allows for the same bytes, with no checkpoint format at all.

* :func:`copy_floor_s`: ``copy_`` of every tensor into preallocated, first-touched buffers
  (the least a staged copy can cost);
* :func:`raw_write_floor_s`: every tensor's bytes written in order into one file with
  ``os.write``, then fsync of the file and its folder (the least a durable local save costs);
* :func:`checksum_rate` and :func:`zstd_rate`: one thread's xxh3-128 and zstd (level 3, the
  writer's) throughput over the same bytes, in bytes per second;
* :func:`load_s`: one ``dcp.load`` into preallocated tensors, checked against the source.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import xxhash
import zstandard
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from dcp_safe.bench.measure import State, tensor_bytes, tensors_of


def _byte_view(tensor: torch.Tensor) -> memoryview:
    array: Any = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return memoryview(array)


def copy_floor_s(state: State, repeats: int = 2) -> float:
    """Fastest of ``repeats`` warm copies of every tensor into preallocated buffers."""
    sources = tensors_of(state)
    buffers = [torch.empty_like(t).zero_() for t in sources]  # first touch before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for dst, src in zip(buffers, sources, strict=True):
            dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def raw_write_floor_s(state: State, folder: Path) -> float:
    """Write every tensor's bytes into ``folder/raw.bin`` and fsync it and ``folder``; time it.

    ``folder`` is created and must not exist; the caller removes it.
    """
    start = time.perf_counter()
    folder.mkdir(parents=True)
    fd = os.open(folder / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for tensor in tensors_of(state):
            view = _byte_view(tensor)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return time.perf_counter() - start


def checksum_rate(state: State) -> float:
    """Bytes per second of xxh3-128 over every tensor, one thread."""
    start = time.perf_counter()
    for tensor in tensors_of(state):
        hasher = xxhash.xxh3_128()
        hasher.update(_byte_view(tensor))
        hasher.digest()
    return tensor_bytes(state) / max(time.perf_counter() - start, 1e-9)


def zstd_rate(state: State) -> float:
    """Bytes per second of zstd (level 3) over every tensor, one thread."""
    compressor = zstandard.ZstdCompressor(level=3)
    start = time.perf_counter()
    for tensor in tensors_of(state):
        compressor.compress(_byte_view(tensor))
    return tensor_bytes(state) / max(time.perf_counter() - start, 1e-9)


def load_s(state: State, reader: Any, checkpoint_id: str | None = None) -> float:
    """Time one ``dcp.load`` of ``state``'s tensors into zeroed copies, then check them.

    Raises:
        AssertionError: a tensor did not round-trip (the figure would be meaningless).
    """
    target: State = {
        k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)
    }
    start = time.perf_counter()
    dcp_load(target, checkpoint_id=checkpoint_id, storage_reader=reader, no_dist=True)
    seconds = time.perf_counter() - start
    for key, value in target.items():
        if not torch.equal(value, state[key]):
            raise AssertionError(f"load: {key} did not round-trip")
    return seconds
