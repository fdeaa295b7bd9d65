"""Shared staging slabs: buffers a worker process maps once, with no name and no fd per tensor."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from dcp_safe.errors import ConfigError
from dcp_safe.staging import BudgetedStager
from dcp_safe.staging.shared import SharedSlabs


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_each_buffer_owns_a_storage_of_exactly_its_size() -> None:
    slabs = SharedSlabs()
    buffers = [slabs.allocate(size) for size in (1, 100, 4096, 3 << 20)]
    places = [slabs.place_of(b) for b in buffers]
    for buffer, place, size in zip(buffers, places, (1, 100, 4096, 3 << 20), strict=True):
        assert buffer.untyped_storage().nbytes() == size
        assert place is not None and place.nbytes == size
        assert place.offset % 64 == 0
    assert len({(p.slab, p.offset) for p in places if p is not None}) == 4
    assert slabs.place_of(torch.zeros(4)) is None  # not ours
    assert slabs.place_of(buffers[2][:10]) is not None  # a view of a buffer: its storage is
    slabs.close()


def test_ten_thousand_buffers_take_a_few_descriptors_and_no_shm_name() -> None:
    fds, shm = _open_fds(), _shm()
    slabs = SharedSlabs()
    buffers = [slabs.allocate(32 << 10) for _ in range(10_000)]
    assert len(slabs.slab_ids()) <= 6  # 312 MiB in 64 MiB slabs
    assert _open_fds() - fds <= 2 * 6  # a slab's descriptor, and its map's own duplicate
    assert _shm() == shm
    del buffers
    gc.collect()
    slabs.close()
    assert _open_fds() == fds


def test_a_slab_whose_buffers_are_gone_is_closed() -> None:
    slabs = SharedSlabs()
    large = slabs.allocate(32 << 20)  # a private slab
    small = slabs.allocate(1024)
    assert len(slabs.slab_ids()) == 2
    del large
    gc.collect()
    assert len(slabs.slab_ids()) == 1  # the current slab stays, for the next buffers
    del small
    slabs.close()


def test_a_shared_stager_stages_into_its_slabs_unpinned() -> None:
    state = {"w": torch.randn(64, 64), "b": torch.arange(10), "step": 3}
    with BudgetedStager(shared_memory=True) as stager:
        assert stager.shared is not None and stager.stats().pinned_bytes == 0
        staged = stager.stage(state).result(60)
        for key in ("w", "b"):
            assert stager.shared.place_of(staged[key]) is not None
            assert torch.equal(staged[key], state[key])
        assert staged["step"] == 3
        del staged


def test_shared_buffers_are_never_pinned() -> None:
    with pytest.raises(ConfigError, match="not pinned"):
        BudgetedStager(shared_memory=True, pin_memory="on")
