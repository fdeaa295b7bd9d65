"""BufferPool: reuse, accounting, the two release strengths, trim and close."""

from __future__ import annotations

import pytest
import torch

from dcp_safe.errors import ConfigError
from dcp_safe.staging.pool import BufferPool, PinMemory

SIZES = [4096, 1024, 4096, 8]


def _lease(pool: BufferPool, sizes: list[int]):  # type: ignore[no-untyped-def]
    with pool.condition:
        lease = pool.lease(sizes)
    lease.materialize()
    return lease


def test_second_lease_of_same_sizes_allocates_nothing() -> None:
    pool = BufferPool(pin_memory="off")
    first = _lease(pool, SIZES)
    assert first.allocated_bytes == sum(SIZES)
    first.release(writer_done=True)
    with pool.condition:
        assert pool.plan(SIZES) == (sum(SIZES), 0)
    second = _lease(pool, SIZES)
    assert second.allocated_bytes == 0
    stats = pool.stats()
    assert stats.allocations == len(SIZES) and stats.reuses == len(SIZES)
    assert stats.allocated_bytes == stats.in_use_bytes == sum(SIZES)
    assert [b.numel() for b in second.buffers] == SIZES


def test_accounting_through_a_lease() -> None:
    pool = BufferPool(pin_memory=False)
    with pool.condition:
        lease = pool.lease([100, 200])
    # Reserved bytes count before they are allocated, so admission sees them.
    assert pool.stats().allocated_bytes == 300 and pool.stats().allocations == 0
    lease.materialize()
    assert pool.stats().in_use_bytes == 300 and pool.stats().free_bytes == 0
    lease.release(writer_done=True)
    lease.release(writer_done=True)  # only the first call counts
    s = pool.stats()
    assert (s.allocated_bytes, s.in_use_bytes, s.free_bytes, s.pinned_bytes) == (300, 0, 300, 0)


def test_unmaterialized_lease_release_returns_the_reservation() -> None:
    pool = BufferPool(pin_memory="off")
    with pool.condition:
        lease = pool.lease([64])
    lease.release(writer_done=True)
    assert pool.stats().allocated_bytes == 0


def test_buffer_viewed_from_outside_stays_pending_until_unshared() -> None:
    pool = BufferPool(pin_memory="off")
    lease = _lease(pool, [64, 32])
    kept = lease.buffers[0].view(torch.float32)[:4]  # someone still reads this buffer
    kept.fill_(7.0)
    lease.release(writer_done=False)
    s = pool.stats()
    assert s.pending_bytes == 64 and s.free_bytes == 32
    again = _lease(pool, [64, 32])
    assert again.allocated_bytes == 64  # not reused while viewed
    assert torch.equal(kept, torch.full((4,), 7.0))
    del kept
    again.release(writer_done=True)
    s = pool.stats()
    assert s.pending_bytes == 0 and s.free_bytes == 64 + 64 + 32


def test_writer_done_release_reuses_even_if_referenced() -> None:
    pool = BufferPool(pin_memory="off")
    lease = _lease(pool, [64])
    stale = lease.buffers[0][:8]  # e.g. held by a failed upload's traceback, never read again
    lease.release(writer_done=True)
    assert pool.stats().free_bytes == 64
    del stale


def test_trim_and_close_free_buffers() -> None:
    pool = BufferPool(pin_memory="off")
    _lease(pool, [1000, 10]).release(writer_done=True)
    held = _lease(pool, [5])
    assert pool.trim(10) == 1000
    assert pool.stats().free_bytes == 10
    pool.close()
    s = pool.stats()
    assert s.free_bytes == 0 and s.allocated_bytes == 5
    held.release(writer_done=True)  # freed, not kept, after close
    assert pool.stats().allocated_bytes == 0


def test_warm_allocates_once() -> None:
    pool = BufferPool(pin_memory="off")
    assert pool.warm(SIZES) == sum(SIZES)
    assert pool.warm(SIZES) == 0
    assert _lease(pool, SIZES).allocated_bytes == 0


def test_pin_memory_modes() -> None:
    assert PinMemory.coerce(True) is PinMemory.ON
    assert PinMemory.coerce("off") is PinMemory.OFF
    assert PinMemory.coerce("auto").resolve() == torch.cuda.is_available()
    with pytest.raises(ConfigError):
        PinMemory.coerce("sometimes")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            PinMemory.ON.resolve()
