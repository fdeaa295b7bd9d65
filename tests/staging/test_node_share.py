"""Ranks on one node share one envelope; the cgroup-aware available-memory signal."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_safe.errors import BudgetExceededError, ConfigError
from dcp_safe.host_memory import available_bytes_now
from dcp_safe.staging.budget import MemoryBudget
from dcp_safe.staging.capacity import node_budget
from dcp_safe.staging.pool import BufferPool

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts outside torchrun; tests that need the variable set it."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def _example_node() -> MemoryBudget:
    """The 512 GiB node of docs/capacity.md."""
    return node_budget(
        usable_bytes=512 * GiB,
        training_peak_bytes=250 * GiB,
        other_consumers_bytes=70 * GiB,
        reserve_bytes=64 * GiB,
    )


def test_eight_ranks_split_the_example_node() -> None:
    node = _example_node()
    rank = dataclasses.replace(node, share=1 / 8)
    assert node.envelope_bytes == rank.node_envelope_bytes == 128 * GiB
    assert rank.envelope_bytes == 16 * GiB
    assert rank.base_available_bytes == 24 * GiB and rank.reserve == 8 * GiB
    assert rank.node_reserve == 64 * GiB
    assert 8 * rank.envelope_bytes == node.envelope_bytes
    text = rank.explain()
    assert text.startswith("envelope 16.00 GiB")
    assert "node envelope 128.00 GiB" in text and "share 1/8" in text
    assert "reserve 64.00 GiB (68719476736 B) x share 1/8 = 8.00 GiB" in text
    # The node's own terms are still there, after the per-rank arithmetic.
    assert "usable RAM 512.00 GiB" in text and "training peak 250.00 GiB" in text


def test_share_one_is_the_node() -> None:
    node = MemoryBudget(usable_bytes=10 * GiB, available_bytes=7 * GiB)
    assert node.share == 1.0
    assert node.envelope_bytes == node.node_envelope_bytes
    assert node.reserve == node.node_reserve
    assert "share" not in node.explain()


@given(
    usable=st.integers(1, 1 << 42),
    peak=st.integers(0, 1 << 42),
    reserve=st.integers(0, 1 << 40),
    ranks=st.integers(1, 64),
)
def test_ranks_never_sum_to_more_than_the_node(
    usable: int, peak: int, reserve: int, ranks: int
) -> None:
    node = MemoryBudget(usable_bytes=usable, training_peak_bytes=peak, reserve_bytes=reserve)
    rank = dataclasses.replace(node, share=1 / ranks)
    assert ranks * rank.envelope_bytes <= node.envelope_bytes
    # Whole-byte rounding only: at most two bytes per rank are lost.
    assert node.envelope_bytes - ranks * rank.envelope_bytes <= 2 * ranks
    assert ranks * rank.reserve >= node.reserve


@given(
    usable=st.integers(1, 1 << 40),
    available=st.integers(0, 1 << 40),
    reserve=st.integers(0, 1 << 38),
    ranks=st.integers(1, 16),
    projected=st.integers(0, 1 << 40),
)
def test_shared_admission_matches_the_shared_envelope(
    usable: int, available: int, reserve: int, ranks: int, projected: int
) -> None:
    b = MemoryBudget(
        usable_bytes=usable, available_bytes=available, reserve_bytes=reserve, share=1 / ranks
    )
    a = b.admit(request_bytes=0, projected_bytes=projected, in_flight=0, max_in_flight=1)
    assert a.admitted == (projected <= b.envelope_bytes)


def _from_host(tmp_path: Path, **kwargs: object) -> MemoryBudget:
    """``from_host`` on a fake 8 GiB cgroup, with a given node peak so the figures are fixed."""
    _write(tmp_path / "proc_cgroup", "0::/job\n")
    _write(tmp_path / "cg" / "job" / "memory.max", f"{8 * GiB}\n")
    return MemoryBudget.from_host(
        cgroup_root=tmp_path / "cg",
        proc_self_cgroup=tmp_path / "proc_cgroup",
        training_peak_bytes=2 * GiB,
        reserve_bytes=2 * GiB,
        **kwargs,  # type: ignore[arg-type]
    )


def test_from_host_alone_on_the_node_takes_it_all(tmp_path: Path) -> None:
    b = _from_host(tmp_path)
    assert b.share == 1.0 and b.envelope_bytes == 4 * GiB
    assert "LOCAL_WORLD_SIZE unset" in b.share_source


def test_from_host_honours_torchrun_local_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    b = _from_host(tmp_path)
    assert b.share == 1 / 8
    assert b.node_envelope_bytes == 4 * GiB and b.envelope_bytes == GiB // 2
    assert "share 1/8 (LOCAL_WORLD_SIZE=8)" in b.explain()


def test_from_host_argument_beats_environment_and_share_beats_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    four = _from_host(tmp_path, local_world_size=4)
    assert four.share == 1 / 4 and four.envelope_bytes == GiB
    assert four.share_source == "local_world_size=4"
    half = _from_host(tmp_path, local_world_size=4, share=0.5)
    assert half.share == 0.5 and half.envelope_bytes == 2 * GiB
    # An explicit choice does not depend on the environment, even a broken one.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert _from_host(tmp_path, share=0.25).envelope_bytes == GiB
    assert _from_host(tmp_path, local_world_size=2).envelope_bytes == 2 * GiB


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_bad_local_world_size_says_what_it_is(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"local_world_size must be an int >= 1.*ranks on this"):
        _from_host(tmp_path, local_world_size=value)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_bad_share_says_the_range(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"share must be a number in \(0, 1\]"):
        _from_host(tmp_path, share=value)
    with pytest.raises(ConfigError, match=r"share must be a number in \(0, 1\]"):
        MemoryBudget(usable_bytes=GiB, share=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["eight", "0", "-3", "2.5"])
def test_bad_local_world_size_variable_says_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", raw)
    with pytest.raises(ConfigError) as info:
        _from_host(tmp_path)
    message = str(info.value)
    assert f"LOCAL_WORLD_SIZE={raw!r} is not a positive integer" in message
    assert "local_world_size=" in message and "share=" in message


def test_per_rank_envelope_is_compared_with_pinned_rounded_bytes() -> None:
    # The pool counts a pinned buffer as the caching host allocator's power-of-two block, and
    # the stager checks those costs against this rank's envelope (16 GiB of the example node).
    rank = dataclasses.replace(_example_node(), share=1 / 8)
    pool = BufferPool(pin_memory="off")
    pool.pin = True  # cost() is arithmetic only: no pinned allocation happens here
    sizes = [184 * MiB] * 65
    assert pool.cost(184 * MiB) == 256 * MiB
    assert sum(sizes) < rank.envelope_bytes  # 11.68 GiB of tensors...
    pinned = sum(pool.cost(s) for s in sizes)
    assert pinned == 65 * 256 * MiB  # ...take 16.25 GiB pinned
    with pytest.raises(BudgetExceededError, match="share 1/8"):
        rank.check_fits(pinned)


class _VirtualMemory(NamedTuple):
    total: int
    available: int


def _fake_psutil(monkeypatch: pytest.MonkeyPatch, *, total: int, available: int) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: _VirtualMemory(total, available))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cgroup(tmp_path: Path, *, limit: int, current: int, inactive_file: int) -> dict[str, Path]:
    _write(tmp_path / "proc_cgroup", "0::/job/rank0\n")
    job = tmp_path / "cg" / "job"
    _write(job / "memory.max", f"{limit}\n")
    _write(job / "rank0" / "memory.max", "max\n")
    _write(job / "memory.current", f"{current}\n")
    _write(job / "memory.stat", f"anon 1\ninactive_file {inactive_file}\nactive_file 7\n")
    return {"cgroup_root": tmp_path / "cg", "proc_self_cgroup": tmp_path / "proc_cgroup"}


def test_available_now_uses_a_binding_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _cgroup(tmp_path, limit=16 * GiB, current=12 * GiB, inactive_file=GiB)
    _fake_psutil(monkeypatch, total=512 * GiB, available=300 * GiB)
    # The host has 300 GiB free, but this container may use only 16 - 12 + 1 GiB more.
    assert available_bytes_now(**paths) == 5 * GiB
    # Same source as the budget.
    assert MemoryBudget.from_host(**paths).available_bytes == 5 * GiB
    # When the host is tighter than the cgroup, the host wins.
    _fake_psutil(monkeypatch, total=512 * GiB, available=3 * GiB)
    assert available_bytes_now(**paths) == 3 * GiB


def test_available_now_ignores_a_cgroup_above_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _cgroup(tmp_path, limit=1024 * GiB, current=12 * GiB, inactive_file=0)
    _fake_psutil(monkeypatch, total=512 * GiB, available=300 * GiB)
    assert available_bytes_now(**paths) == 300 * GiB
    none = {"cgroup_root": tmp_path / "none", "proc_self_cgroup": tmp_path / "none"}
    assert available_bytes_now(**none) == 300 * GiB


def test_available_now_is_never_negative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _cgroup(tmp_path, limit=16 * GiB, current=17 * GiB, inactive_file=0)
    _fake_psutil(monkeypatch, total=512 * GiB, available=300 * GiB)
    assert available_bytes_now(**paths) == 0


def test_available_now_reads_the_real_host() -> None:
    assert available_bytes_now() >= 0
