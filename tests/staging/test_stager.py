"""BudgetedStager with real DCP async saves, real files, and a delaying/failing file system."""

from __future__ import annotations

import copy
import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from dcp_safe.errors import AdmissionTimeoutError, BudgetExceededError, ConfigError, DcpSafeError
from dcp_safe.staging import BudgetedStager, MemoryBudget, StagerOptions

MiB = 1 << 20


class SlowFileSystem(LocalFileSystem):
    """Local files, with a delay before every file opened for writing and injectable failures."""

    protocol = ("slowfile",)
    root_marker = "/"
    delay_s = 0.0
    fail_writes = 0
    _lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        if path.startswith("slowfile://"):
            path = path[len("slowfile://") :]
        return super()._strip_protocol(path)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and str(path).endswith(".distcp"):
            time.sleep(SlowFileSystem.delay_s)
            with SlowFileSystem._lock:
                if SlowFileSystem.fail_writes > 0:
                    SlowFileSystem.fail_writes -= 1
                    raise OSError("injected write failure")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)


@pytest.fixture
def slow_fs() -> Iterator[type[SlowFileSystem]]:
    yield SlowFileSystem
    SlowFileSystem.delay_s = 0.0
    SlowFileSystem.fail_writes = 0


def _budget(envelope: int = 64 * MiB) -> MemoryBudget:
    return MemoryBudget(usable_bytes=envelope, reserve_bytes=0)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
            "t": torch.randn(16, 16, generator=g).t(),  # not contiguous
            "empty": torch.empty(0, 4),
            "step_tensor": torch.tensor(seed),
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(64, 32, generator=g)}}},
        "extra": {"step": seed, "history": [seed, {"lr": 0.1}], "name": "run7"},
    }


def _template(obj: Any) -> Any:
    """The same structure with every value blanked, to load into."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _template(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_template(v) for v in obj]
    return None


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in _tensors(v)]
    return []


def _load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = _template(like)
    dcp.load(loaded, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return loaded


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def _save(stager: BudgetedStager, state: dict[str, Any], path: Path, **kw: Any) -> Any:
    return dcp.async_save(
        state, storage_writer=FileSystemWriter(str(path)), async_stager=stager, no_dist=True, **kw
    )


def test_async_save_returns_separate_futures_and_round_trips(tmp_path: Path) -> None:
    state = _state(3)
    with BudgetedStager(_budget()) as stager:
        response = _save(stager, state, tmp_path / "c")
        assert isinstance(response, dcp.state_dict_saver.AsyncSaveResponse)
        response.staging_completion.result()
        response.upload_completion.result()
    assert _equal(_load(tmp_path / "c", state), state)


def test_mutation_after_staging_never_reaches_the_checkpoint(tmp_path: Path) -> None:
    state = _state(1)
    mismatches = 0
    saves = 100
    with BudgetedStager(_budget()) as stager:
        expected: list[dict[str, Any]] = []
        for i in range(saves):
            state["extra"]["step"] = i
            expected.append(copy.deepcopy(state))
            response = _save(stager, state, tmp_path / f"c{i}")
            response.staging_completion.result()
            # The next "optimizer step" runs while the upload is still writing.
            for t in _tensors(state):
                t.add_(1) if t.dtype != torch.int64 else t.add_(7)
            state["extra"]["history"][1]["lr"] += 1.0
            state["extra"]["history"].append(i)
            state["extra"]["name"] = f"mutated{i}"
            response.upload_completion.result()
        assert stager.stats().allocations == len([t for t in _tensors(state) if t.nbytes])
    for i in range(saves):
        mismatches += not _equal(_load(tmp_path / f"c{i}", expected[i]), expected[i])
    assert mismatches == 0


def test_second_and_later_saves_allocate_no_new_bytes(tmp_path: Path) -> None:
    state = _state()
    with BudgetedStager(_budget()) as stager:
        for i in range(4):
            response = _save(stager, state, tmp_path / f"c{i}")
            response.staging_completion.result()
            response.upload_completion.result()
            s = stager.stats()
            if i == 0:
                first = s
                assert s.last_allocated_bytes > 0
            else:
                assert s.last_allocated_bytes == 0
                assert s.allocated_bytes_total == first.allocated_bytes_total
                assert s.pool_bytes == first.pool_bytes
        assert stager.stats().reuses == 3 * stager.stats().allocations


def test_warm_up_makes_the_first_save_allocate_nothing(tmp_path: Path) -> None:
    state = _state()
    with BudgetedStager(_budget()) as stager:
        warmed = stager.warm_up(state)
        assert warmed > 0 and stager.warm_up(state) == 0
        response = _save(stager, state, tmp_path / "c")
        response.upload_completion.result()
        assert stager.stats().last_allocated_bytes == 0


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_burst_against_slow_storage_stays_bounded(
    tmp_path: Path, slow_fs: type[SlowFileSystem], max_in_flight: int
) -> None:
    slow_fs.delay_s = 0.05
    state = {f"layer{i}": torch.randn(256, 256) for i in range(4)}  # 1 MiB
    envelope = int(1.5 * max_in_flight * MiB)
    seen = {"in_flight": 0, "pool": 0}
    stop = threading.Event()
    with BudgetedStager(
        _budget(envelope), options=StagerOptions(max_in_flight=max_in_flight, timeout_s=60)
    ) as stager:

        def sample() -> None:
            while not stop.is_set():
                s = stager.stats()
                seen["in_flight"] = max(seen["in_flight"], s.in_flight)
                seen["pool"] = max(seen["pool"], s.pool_bytes)
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        responses = []
        for i in range(10):
            writer = FsspecWriter(f"slowfile://{tmp_path}/c{i}", sync_files=False)
            responses.append(
                dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
            )
        for r in responses:
            r.upload_completion.result()
        stop.set()
        sampler.join()
        s = stager.stats()
    assert s.admitted == 10 and s.refused == 0
    assert s.peak_in_flight <= max_in_flight and seen["in_flight"] <= max_in_flight
    assert s.peak_pool_bytes <= envelope and seen["pool"] <= envelope
    assert s.total_wait_s > 0  # the burst was throttled, not queued
    for i in (0, 9):
        assert _equal(_load(tmp_path / f"c{i}", state), state)


def test_failed_upload_releases_buffers_and_next_save_works(
    tmp_path: Path, slow_fs: type[SlowFileSystem]
) -> None:
    state = _state()
    # Room for one generation only: the next save must reuse the failed one's buffers.
    envelope = int(1.5 * sum(t.nbytes for t in _tensors(state)))
    with BudgetedStager(_budget(envelope), options=StagerOptions(timeout_s=30)) as stager:
        slow_fs.fail_writes = 1
        failed = stager.async_save(
            state, storage_writer=FsspecWriter(f"slowfile://{tmp_path}/bad"), no_dist=True
        )
        with pytest.raises(BaseException, match="injected write failure"):
            failed.upload_completion.result()
        s = stager.stats()
        assert s.in_flight == 0 and s.in_use_bytes == 0 and s.free_bytes == s.pool_bytes
        ok = stager.async_save(
            state, storage_writer=FsspecWriter(f"slowfile://{tmp_path}/good"), no_dist=True
        )
        ok.upload_completion.result()
        assert stager.stats().last_allocated_bytes == 0
        del failed  # the failed response stays alive until here, holding its traceback
    assert _equal(_load(tmp_path / "good", state), state)


def test_untracked_failed_upload_is_released_when_its_response_is_dropped(
    tmp_path: Path, slow_fs: type[SlowFileSystem]
) -> None:
    state = _state()
    with BudgetedStager(_budget(), options=StagerOptions(timeout_s=30)) as stager:
        slow_fs.fail_writes = 1
        failed = dcp.async_save(
            state,
            storage_writer=FsspecWriter(f"slowfile://{tmp_path}/bad"),
            async_stager=stager,
            no_dist=True,
        )
        with pytest.raises(BaseException, match="injected write failure"):
            failed.upload_completion.result()
        del failed
        gc.collect()
        deadline = time.monotonic() + 30
        while stager.stats().in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stager.stats().in_flight == 0
        ok = _save(stager, state, tmp_path / "good")
        ok.upload_completion.result()
        assert stager.stats().last_allocated_bytes == 0


def test_state_larger_than_envelope_raises_budget_exceeded(tmp_path: Path) -> None:
    state = {"w": torch.zeros(MiB // 4)}  # 1 MiB
    with BudgetedStager(_budget(MiB // 2)) as stager:
        with pytest.raises(BudgetExceededError, match=r"1\.00 MiB.*envelope 512\.00 KiB"):
            _save(stager, state, tmp_path / "c")
        with pytest.raises(BudgetExceededError):
            stager.warm_up(state)
        assert stager.stats().pool_bytes == 0


def test_busy_stager_refuses_or_times_out(tmp_path: Path, slow_fs: type[SlowFileSystem]) -> None:
    slow_fs.delay_s = 1.0
    state = _state()
    for when_busy in ("raise", "wait"):
        with BudgetedStager(
            _budget(), options=StagerOptions(when_busy=when_busy, timeout_s=0.2)
        ) as stager:
            first = stager.async_save(
                state,
                storage_writer=FsspecWriter(f"slowfile://{tmp_path}/{when_busy}"),
                no_dist=True,
            )
            with pytest.raises(AdmissionTimeoutError, match="max_in_flight=1") as info:
                _save(stager, state, tmp_path / f"{when_busy}2")
            assert isinstance(info.value, TimeoutError)
            assert stager.stats().refused == 1
            first.upload_completion.result()


def test_close_waits_for_work_in_flight_and_propagates_its_error(
    tmp_path: Path, slow_fs: type[SlowFileSystem]
) -> None:
    slow_fs.delay_s = 0.3
    slow_fs.fail_writes = 1
    stager = BudgetedStager(_budget(), options=StagerOptions(timeout_s=30))
    response = stager.async_save(
        _state(), storage_writer=FsspecWriter(f"slowfile://{tmp_path}/c"), no_dist=True
    )
    with pytest.raises(BaseException, match="injected write failure"):
        stager.close()
    assert response.upload_completion.done()
    assert stager.stats().pool_bytes == 0
    with pytest.raises(DcpSafeError, match="after close"):
        stager.stage(_state())


def test_close_waits_for_a_successful_upload(tmp_path: Path, slow_fs: type[SlowFileSystem]) -> None:
    slow_fs.delay_s = 0.2
    stager = BudgetedStager(_budget(), options=StagerOptions(timeout_s=30))
    response = dcp.async_save(
        _state(),
        storage_writer=FsspecWriter(f"slowfile://{tmp_path}/c"),
        async_stager=stager,
        no_dist=True,
    )
    stager.close()
    assert response.upload_completion.done() and response.upload_completion.exception() is None


def test_staged_tensor_kept_by_a_caller_is_never_overwritten() -> None:
    state = {"w": torch.ones(1024)}
    with BudgetedStager(_budget()) as stager:
        staged = stager.stage(state).result()
        kept = staged["w"]
        del staged
        state["w"].fill_(2.0)
        again = stager.stage(state).result()
        assert torch.equal(kept, torch.ones(1024)) and torch.equal(again["w"], state["w"])
        assert stager.stats().allocations == 2  # the kept buffer was not reused
        del again


def test_track_without_a_staged_save_is_a_config_error() -> None:
    with BudgetedStager(_budget()) as stager, pytest.raises(ConfigError):
        stager.track(torch.futures.Future())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_in_flight": 0}, {"when_busy": "skip"}, {"timeout_s": -1}, {"pin_memory": "maybe"}],
)
def test_bad_options_raise_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        StagerOptions(**kwargs)


def test_options_are_one_dataclass() -> None:
    options = StagerOptions(max_in_flight=2, when_busy="raise", timeout_s=5.0)
    with BudgetedStager(_budget(), options=options) as stager:
        assert stager.options is options
    with BudgetedStager(_budget()) as stager:
        assert stager.options == StagerOptions()
    with pytest.raises(ConfigError, match="options must be a StagerOptions, got dict"):
        BudgetedStager(_budget(), options={"max_in_flight": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_in_flight", 2),
        ("pin_memory", "off"),
        ("when_busy", "raise"),
        ("timeout_s", 5.0),
        ("mutation_guard", False),
    ],
)
def test_a_keyword_of_the_earlier_layout_names_its_place_in_the_options(
    name: str, value: object
) -> None:
    with pytest.raises(ConfigError, match=rf"\({name}=\) moved to options=StagerOptions\({name}="):
        BudgetedStager(_budget(), **{name: value})


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_inflight'"):
        BudgetedStager(_budget(), max_inflight=2)


def test_works_with_safe_storage_writer(tmp_path: Path) -> None:
    writer_module = pytest.importorskip("dcp_safe.adapters.writer")
    state = _state(5)
    with BudgetedStager(_budget()) as stager:
        response = stager.async_save(
            state,
            checkpoint_id="step_000001",
            storage_writer=writer_module.SafeStorageWriter(tmp_path),
            no_dist=True,
        )
        response.upload_completion.result()
    assert _equal(_load(tmp_path / "step_000001", state), state)


def test_failed_staging_releases_its_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    with BudgetedStager(_budget()) as stager:
        real = stager._pool._allocate
        calls = {"n": 0}

        def flaky(size: int) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("injected allocation failure")
            return real(size)

        monkeypatch.setattr(stager._pool, "_allocate", flaky)
        with pytest.raises(MemoryError, match="injected"):
            stager.stage(state).result()
        s = stager.stats()
        assert s.in_flight == 0 and s.in_use_bytes == 0
        staged = stager.stage(state).result()
        assert _equal(dict(staged), state)
        del staged


def test_a_cancelled_upload_releases_its_generation() -> None:
    # A future cancelled before it ran (a queued upload the caller gave up) is done without a
    # result or an exception to read: the generation must still go back, not stay in flight
    # with its buffers leased until close() times out.
    stager = BudgetedStager(budget=_budget(), options=StagerOptions(timeout_s=5))
    stager.stage(_state()).result()
    upload: Future[None] = Future()
    stager.track(upload)
    assert stager.stats().in_flight == 1
    assert upload.cancel()
    assert stager.stats().in_flight == 0
    stager.close()  # nothing left in flight: no TimeoutError
