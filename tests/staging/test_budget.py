"""MemoryBudget: the envelope arithmetic, the admission test and reading the host."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_safe.errors import BudgetExceededError, ConfigError
from dcp_safe.staging.budget import MemoryBudget

GiB = 1 << 30


def test_envelope_from_training_peak() -> None:
    b = MemoryBudget(
        usable_bytes=64 * GiB, training_peak_bytes=40 * GiB, other_consumers_bytes=2 * GiB
    )
    assert b.reserve == int(64 * GiB * 0.15)
    assert b.envelope_bytes == 64 * GiB - 40 * GiB - 2 * GiB - b.reserve


def test_envelope_from_available_and_reserve_bytes() -> None:
    b = MemoryBudget(usable_bytes=64 * GiB, available_bytes=30 * GiB, reserve_bytes=4 * GiB)
    assert b.envelope_bytes == 26 * GiB
    # Available memory above usable RAM (a cgroup below the host) is capped at usable.
    capped = MemoryBudget(usable_bytes=8 * GiB, available_bytes=30 * GiB, reserve_bytes=0)
    assert capped.envelope_bytes == 8 * GiB


def test_envelope_never_negative() -> None:
    b = MemoryBudget(usable_bytes=8 * GiB, training_peak_bytes=9 * GiB)
    assert b.envelope_bytes == 0


def test_state_bigger_than_envelope_says_size_envelope_and_how() -> None:
    b = MemoryBudget(usable_bytes=10 * GiB, training_peak_bytes=6 * GiB, reserve_bytes=GiB)
    with pytest.raises(BudgetExceededError) as info:
        b.check_fits(4 * GiB)
    message = str(info.value)
    assert "4.00 GiB" in message  # the state
    assert "envelope 3.00 GiB" in message
    assert "usable RAM 10.00 GiB" in message and "training peak 6.00 GiB" in message
    assert "reserve 1.00 GiB" in message
    with pytest.raises(BudgetExceededError):
        b.admit(request_bytes=4 * GiB, projected_bytes=0, in_flight=0, max_in_flight=1)


def test_admit_refuses_when_in_flight_is_full() -> None:
    b = MemoryBudget(usable_bytes=10 * GiB, reserve_bytes=0)
    a = b.admit(request_bytes=GiB, projected_bytes=GiB, in_flight=1, max_in_flight=1)
    assert not a.admitted and "max_in_flight=1" in a.reason
    a = b.admit(request_bytes=GiB, projected_bytes=GiB, in_flight=1, max_in_flight=2)
    assert a.admitted and "stays above the reserve" in a.reason


def test_admit_refuses_below_reserve() -> None:
    b = MemoryBudget(usable_bytes=10 * GiB, available_bytes=5 * GiB, reserve_bytes=GiB)
    ok = b.admit(request_bytes=2 * GiB, projected_bytes=4 * GiB, in_flight=0, max_in_flight=2)
    assert ok.admitted and ok.projected_available_bytes == GiB
    no = b.admit(request_bytes=2 * GiB, projected_bytes=4 * GiB + 1, in_flight=0, max_in_flight=2)
    assert not no.admitted and "below the reserve" in no.reason


@given(
    usable=st.integers(1, 1 << 40),
    peak=st.integers(0, 1 << 40),
    reserve=st.integers(0, 1 << 38),
    request=st.integers(0, 1 << 40),
    held=st.integers(0, 1 << 40),
    in_flight=st.integers(0, 4),
    max_in_flight=st.integers(1, 4),
)
def test_admitted_means_within_envelope_and_slots(
    usable: int,
    peak: int,
    reserve: int,
    request: int,
    held: int,
    in_flight: int,
    max_in_flight: int,
) -> None:
    b = MemoryBudget(usable_bytes=usable, training_peak_bytes=peak, reserve_bytes=reserve)
    try:
        a = b.admit(
            request_bytes=request,
            projected_bytes=held + request,
            in_flight=in_flight,
            max_in_flight=max_in_flight,
        )
    except BudgetExceededError:
        assert request > b.envelope_bytes
        return
    assert request <= b.envelope_bytes
    assert a.admitted == (in_flight < max_in_flight and held + request <= b.envelope_bytes)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"usable_bytes": 0},
        {"usable_bytes": 1, "training_peak_bytes": -1},
        {"usable_bytes": 1, "reserve_fraction": 1.0},
        {"usable_bytes": 1, "reserve_fraction": -0.1},
        {"usable_bytes": 1, "other_consumers_bytes": -5},
        {"usable_bytes": 1.5},
    ],
)
def test_bad_values_raise_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        MemoryBudget(**kwargs)  # type: ignore[arg-type]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_from_host_reads_cgroup_v2_limit(tmp_path: Path) -> None:
    _write(tmp_path / "proc_cgroup", "0::/job/rank0\n")
    root = tmp_path / "cg"
    _write(root / "job" / "memory.max", f"{4 * GiB}\n")
    _write(root / "job" / "rank0" / "memory.max", "max\n")
    _write(root / "job" / "memory.current", f"{GiB}\n")
    _write(root / "job" / "memory.stat", f"anon 1\ninactive_file {GiB // 2}\n")
    b = MemoryBudget.from_host(cgroup_root=root, proc_self_cgroup=tmp_path / "proc_cgroup")
    assert b.usable_bytes == 4 * GiB
    assert "cgroup v2 memory.max" in b.source
    assert b.available_bytes is not None and b.available_bytes <= 4 * GiB - GiB + GiB // 2
    assert b.reserve == int(4 * GiB * 0.15)


def test_from_host_reads_cgroup_v1_limit_and_ignores_unlimited(tmp_path: Path) -> None:
    _write(tmp_path / "proc_cgroup", "4:memory:/pod\n0::/\n")
    root = tmp_path / "cg"
    _write(root / "memory" / "pod" / "memory.limit_in_bytes", f"{2 * GiB}\n")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    b = MemoryBudget.from_host(cgroup_root=root, proc_self_cgroup=tmp_path / "proc_cgroup")
    assert b.usable_bytes == 2 * GiB and "cgroup v1" in b.source


def test_from_host_without_cgroup_uses_memtotal(tmp_path: Path) -> None:
    b = MemoryBudget.from_host(
        cgroup_root=tmp_path / "none", proc_self_cgroup=tmp_path / "none", reserve_bytes=0
    )
    assert b.source == "MemTotal"
    assert 0 < b.envelope_bytes <= b.usable_bytes
