"""The memory sampler: sees a known spike during a save; reports missing sources as absent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_safe import Runtime
from dcp_safe.errors import ConfigError
from dcp_safe.manager import CheckpointManager
from dcp_safe.telemetry import MemorySampler, Telemetry

MIB = 1 << 20
SPIKE_BYTES = 512 * MIB
DEADLINE_S = 60  # detects hangs only


def _wait_for_samples(sampler: MemorySampler, more: int) -> None:
    target = sampler.count + more
    deadline = time.monotonic() + DEADLINE_S
    while sampler.count < target:
        assert time.monotonic() < deadline, "the sampler stopped sampling"
        time.sleep(0.005)


class _Spike:
    """State whose serialization, inside DCP's write phase, allocates and touches ``nbytes``
    and holds them until the sampler has taken five more samples (counted, not timed)."""

    def __init__(self, sampler: MemorySampler, nbytes: int) -> None:
        self.sampler, self.nbytes = sampler, nbytes

    def __deepcopy__(self, memo: dict[int, Any]) -> _Spike:
        return self  # staging keeps it as it is; the spike happens when it is written

    def __reduce__(self) -> tuple[Any, ...]:
        spike = torch.empty(self.nbytes, dtype=torch.uint8).fill_(1)  # touched: resident
        _wait_for_samples(self.sampler, 5)
        del spike
        return (int, (0,))


def test_sampler_sees_a_512_mib_spike_held_during_a_real_save(tmp_path: Path) -> None:
    with Telemetry(busy_interval_s=0.02, idle_interval_s=1.0) as tel:
        sampler = tel.sampler
        assert sampler is not None
        before = sampler.sample_now().rss_bytes
        assert before is not None
        with CheckpointManager(tmp_path, runtime=Runtime(telemetry=tel)) as manager:
            state = {"w": torch.ones(1024), "spike": _Spike(sampler, SPIKE_BYTES)}
            handle = manager.save(1, state)
            assert handle is not None
            handle.committed.result(DEADLINE_S)
        peak = sampler.peak("rss_bytes")
        report = tel.report()
    assert peak is not None and peak - before >= 0.8 * SPIKE_BYTES
    (save,) = report.saves
    assert save.ok
    assert save.peak_rss_over_band_bytes is not None
    assert save.peak_rss_over_band_bytes >= 0.8 * SPIKE_BYTES


def _fake_proc(root: Path, *, cgroup: str = "") -> Path:
    (root / "self").mkdir(parents=True)
    (root / "self" / "status").write_text("Name:\tpython\nVmRSS:\t  2048 kB\nVmLck:\t0 kB\n")
    (root / "self" / "cgroup").write_text(cgroup)
    return root


def test_missing_sources_are_reported_as_absent(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path / "proc")  # no smaps_rollup, stat, meminfo, vmstat, cgroup
    sampler = MemorySampler(proc_root=str(proc), cgroup_root=str(tmp_path / "no-cgroup"))
    sample = sampler.sample_now()
    assert sample.rss_bytes == 2048 * 1024 and sample.locked_bytes == 0
    for absent in (
        "pss_bytes",
        "uss_bytes",
        "cgroup_current_bytes",
        "cgroup_peak_bytes",
        "host_available_bytes",
        "swap_in_pages",
        "major_faults",
        "pinned_bytes",
    ):
        assert getattr(sample, absent) is None, absent
    assert sampler.peak("pss_bytes") is None
    with pytest.raises(ConfigError, match="unknown sample field"):
        sampler.peak("rss")


def test_cgroup_v2_and_v1_files_are_read_from_the_given_root(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    proc = _fake_proc(v2 / "proc", cgroup="0::/job.slice\n")
    (v2 / "cg" / "job.slice").mkdir(parents=True)
    (v2 / "cg" / "job.slice" / "memory.current").write_text("123456\n")
    (v2 / "cg" / "job.slice" / "memory.peak").write_text("654321\n")
    sample = MemorySampler(proc_root=str(proc), cgroup_root=str(v2 / "cg")).sample_now()
    assert (sample.cgroup_current_bytes, sample.cgroup_peak_bytes) == (123456, 654321)

    v1 = tmp_path / "v1"
    proc = _fake_proc(v1 / "proc", cgroup="5:cpu:/x\n4:memory:/job\n")
    (v1 / "cg" / "memory" / "job").mkdir(parents=True)
    (v1 / "cg" / "memory" / "job" / "memory.usage_in_bytes").write_text("42\n")
    sample = MemorySampler(proc_root=str(proc), cgroup_root=str(v1 / "cg")).sample_now()
    assert (sample.cgroup_current_bytes, sample.cgroup_peak_bytes) == (42, None)


def test_pss_is_read_while_idle_and_never_while_busy() -> None:
    sampler = MemorySampler(pss_interval_s=0.0)
    idle = sampler.sample_now()
    assert idle.rss_bytes is not None and idle.rss_bytes > 0
    assert idle.pss_bytes is not None and idle.uss_bytes is not None  # this host has smaps_rollup
    assert idle.host_available_bytes is not None and idle.major_faults is not None
    with sampler.busy():
        busy = sampler.sample_now()
    assert busy.rss_bytes is not None and busy.pss_bytes is None and busy.uss_bytes is None


def test_sampler_rejects_a_non_positive_interval() -> None:
    with pytest.raises(ConfigError, match="busy_interval_s"):
        MemorySampler(busy_interval_s=0)


# An infinite interval would end the sampler's thread: Event.wait(inf) raises OverflowError.
@pytest.mark.parametrize("bad", [float("inf"), True])
def test_sampler_rejects_an_interval_that_is_not_a_finite_number(bad: object) -> None:
    with pytest.raises(ConfigError, match="idle_interval_s"):
        MemorySampler(idle_interval_s=bad)  # type: ignore[arg-type]
