"""Shared staging slabs: buffers a worker process maps once, with no name and no fd per tensor."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from dcp_safe.errors import ConfigError
from dcp_safe.staging import BudgetedStager, StagerOptions
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


def test_pinned_shared_slabs_need_cuda_as_pinned_buffers_do() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: benchmarks/gpu_check.py checks pinned slabs there")
    with pytest.raises(ConfigError, match="needs CUDA"):
        BudgetedStager(options=StagerOptions(pin_memory="on"), shared_memory=True)
    with BudgetedStager(shared_memory=True) as stager:  # auto: pageable without CUDA
        assert stager.shared is not None and stager.shared.pinning is None


class RecordingPinning:
    """Stands in for the CUDA runtime: records what is locked, checks each unlock matches."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.locked: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def pin(self, pointer: int, nbytes: int) -> None:
        self.calls.append(("pin", pointer))
        if self.refuse:
            raise OSError("cudaHostRegister ... failed (cudaError 2): refused for the test")
        assert pointer not in self.locked
        self.locked[pointer] = nbytes

    def unpin(self, pointer: int) -> None:
        self.calls.append(("unpin", pointer))
        del self.locked[pointer]  # only what was locked


def test_each_slab_is_locked_once_whole_and_unlocked_before_it_goes() -> None:
    pinning = RecordingPinning()
    slabs = SharedSlabs(pinning=pinning)
    small = [slabs.allocate(4096) for _ in range(3)]  # one shared slab
    large = slabs.allocate(32 << 20)  # a slab of its own
    assert len(pinning.locked) == 2 and sorted(pinning.locked.values()) == [32 << 20, 64 << 20]
    for buffer in (*small, large):  # every buffer lies inside a locked range
        pointer = buffer.data_ptr()
        assert any(p <= pointer < p + n for p, n in pinning.locked.items())
    assert slabs.pinned_bytes() == (32 << 20) + (64 << 20)
    large.fill_(7)
    del large, buffer
    gc.collect()
    assert sorted(pinning.locked.values()) == [64 << 20]  # unlocked with its slab
    assert slabs.pinned_bytes() == 64 << 20
    del small[0]
    gc.collect()
    assert sorted(pinning.locked.values()) == [64 << 20]  # its slab still holds two buffers
    slabs.close()
    assert pinning.locked == {} and slabs.pinned_bytes() == 0
    assert all(torch.equal(b, torch.zeros(4096, dtype=torch.uint8)) for b in small)  # still mapped


def test_freed_buffers_of_a_locked_slab_keep_their_pages() -> None:
    # Punching a hole in locked pages would leave the runtime's copies landing in the old ones.
    slabs = SharedSlabs(pinning=RecordingPinning())
    keep = slabs.allocate(4096)
    freed = slabs.allocate(1 << 20)
    place = slabs.place_of(freed)
    assert place is not None
    freed.fill_(5)
    del freed
    gc.collect()
    slab_pages = torch.frombuffer(slabs._slabs[place.slab].map, dtype=torch.uint8)
    assert int(slab_pages[place.offset : place.offset + place.nbytes].min()) == 5
    del keep, slab_pages
    slabs.close()


def test_a_slab_the_runtime_refuses_to_lock_stays_usable_and_pageable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slabs = SharedSlabs(pinning=RecordingPinning(refuse=True))
    buffer = slabs.allocate(4096)
    buffer.copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
    assert int(buffer[255]) == 255
    assert slabs.pinned_bytes() == 0
    assert "stays pageable" in caplog.text and "cudaError 2" in caplog.text
    del buffer
    slabs.close()


def test_a_pinned_shared_stager_reports_its_locked_slabs() -> None:
    state = {"w": torch.randn(64, 64), "b": torch.arange(10), "step": 3}
    with BudgetedStager(options=StagerOptions(pin_memory="off"), shared_memory=True) as stager:
        assert stager.shared is not None
        stager.shared.pinning = pinning = RecordingPinning()  # a CUDA host, for the slabs
        staged = stager.stage(state).result(60)
        assert torch.equal(staged["w"], state["w"]) and staged["step"] == 3
        assert stager.stats().pinned_bytes == sum(pinning.locked.values()) > 0
        del staged
