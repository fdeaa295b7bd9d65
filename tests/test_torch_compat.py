"""dcp_safe.torch_compat: the private torch APIs, each behaving as its caller relies on."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, state_dict_saver

import dcp_safe
from dcp_safe import BudgetedStager, SafeStorageWriter
from dcp_safe import torch_compat as dcp_compat
from dcp_safe.torch_compat import dcp_debug_logs_unheard

DCP_LOGGER = logging.getLogger("c10d-NullHandler-dcp_logger")


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1


def _save_flat(root: Path, keys: int) -> None:
    state = {f"k{i}": torch.zeros(2) for i in range(keys)}
    dcp_safe.save(state, storage_writer=SafeStorageWriter(root), checkpoint_id="c", no_dist=True)


def test_dcps_per_key_debug_records_are_not_made_while_nobody_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert DCP_LOGGER.level == logging.DEBUG  # torch's setting, which this works around
    made: list[str] = []
    real = logging.Logger.makeRecord

    def counting(self: logging.Logger, *args: object, **kwargs: object) -> logging.LogRecord:
        if self is DCP_LOGGER:
            made.append(self.name)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(logging.Logger, "makeRecord", counting)
    # As outside pytest: torch's NullHandler only (pytest hangs its capture on every logger).
    quiet = [h for h in DCP_LOGGER.handlers if type(h) is logging.NullHandler]
    monkeypatch.setattr(DCP_LOGGER, "handlers", quiet)
    _save_flat(tmp_path, 50)
    assert made == []
    assert DCP_LOGGER.level == logging.DEBUG  # restored after the call


def test_a_handler_that_takes_debug_records_still_gets_every_one(tmp_path: Path) -> None:
    handler = _Count()
    DCP_LOGGER.addHandler(handler)
    try:
        with dcp_debug_logs_unheard():
            assert DCP_LOGGER.level == logging.DEBUG  # someone listens: nothing changes
        _save_flat(tmp_path, 50)
    finally:
        DCP_LOGGER.removeHandler(handler)
    assert handler.records >= 100  # two a key, and the save's own


class _Counter:
    """A top-level ``Stateful`` value: DCP saves what its ``state_dict()`` returns."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"count": torch.tensor([7])}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """As outside pytest: nothing takes DCP's DEBUG records (pytest's capture would)."""
    for log in (DCP_LOGGER, logging.getLogger()):
        monkeypatch.setattr(
            log, "handlers", [h for h in log.handlers if type(h) is logging.NullHandler]
        )


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Quiet DCP's logger (:func:`_quiet`) and record each of DCP's per-key walks of a state."""
    _quiet(monkeypatch)
    walked: list[int] = []
    real_walk = state_dict_saver._stateful_to_state_dict
    monkeypatch.setattr(
        state_dict_saver, "_stateful_to_state_dict", lambda s: walked.append(1) or real_walk(s)
    )
    return walked


def test_dcp_save_hands_dcp_the_stateful_values_resolved_without_its_per_key_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walked = _count_walks(monkeypatch)
    counter = _Counter()
    param = torch.nn.Parameter(torch.arange(3.0))
    state = {"w": torch.ones(2), "p": param, "counter": counter, "step": 3}
    ours = dcp_safe.save(
        state, storage_writer=SafeStorageWriter(tmp_path), checkpoint_id="c", no_dist=True
    )
    assert walked == []  # the fast path was taken
    assert counter.calls == 1
    theirs = dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "torch"), no_dist=True)
    assert walked == [1]
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    back = {
        "w": torch.zeros(2),
        "p": torch.zeros(3),
        "counter": {"count": torch.zeros(1, dtype=torch.int64)},
        "step": 0,
    }
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(back["p"], param.detach()) and back["counter"]["count"].item() == 7
    assert back["step"] == 3


def test_a_tensor_carrying_the_protocols_methods_is_still_stateful(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _quiet(monkeypatch)
    odd = torch.ones(2)
    odd.state_dict = lambda: {"inner": torch.full((2,), 5.0)}  # type: ignore[attr-defined]
    odd.load_state_dict = lambda state: None  # type: ignore[attr-defined]
    metadata = dcp_safe.save(
        {"odd": odd}, storage_writer=SafeStorageWriter(tmp_path), checkpoint_id="c", no_dist=True
    )
    assert set(metadata.state_dict_metadata) == {"odd.inner"}


def test_async_save_resolves_stateful_values_once_and_skips_dcps_per_key_walks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walked = _count_walks(monkeypatch)
    counter = _Counter()
    state = {"w": torch.ones(2), "p": torch.nn.Parameter(torch.arange(3.0)), "counter": counter}
    with BudgetedStager() as stager:
        response = dcp_safe.async_save(
            state,
            storage_writer=SafeStorageWriter(tmp_path),
            checkpoint_id="c",
            async_stager=stager,
            no_dist=True,
        )
        response.staging_completion.result(60)
        ours = response.upload_completion.result(60)
    assert walked == []  # neither on this thread nor on the upload thread
    assert counter.calls == 1
    with BudgetedStager() as stager:  # DCP's own, on the same kind of copy
        response = state_dict_saver.async_save(
            state,
            storage_writer=FileSystemWriter(tmp_path / "torch"),
            async_stager=stager,
            no_dist=True,
        )
        theirs = response.upload_completion.result(60)
    assert walked == [1, 1]  # DCP walks the state, then its staged copy
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    back = {"w": torch.zeros(2), "p": torch.zeros(3), "counter": {"count": torch.zeros(1)}}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(back["p"], torch.arange(3.0)) and back["counter"]["count"].item() == 7


def test_async_save_hands_a_failed_staging_to_its_staging_future(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _quiet(monkeypatch)  # else DCP's own async_save runs, which resolves it with None

    class Refuses(BudgetedStager):
        def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
            failed: Future[dict[str, Any]] = Future()
            failed.set_exception(RuntimeError("staging refused (test)"))
            return failed

    with Refuses() as stager:
        response = dcp_compat.dcp_async_save(
            {"w": torch.ones(2)},
            storage_writer=SafeStorageWriter(tmp_path),
            checkpoint_id="c",
            async_stager=stager,
            no_dist=True,
        )
        with pytest.raises(RuntimeError, match="staging refused"):
            response.staging_completion.result(60)
        with pytest.raises(RuntimeError, match="staging refused"):
            response.upload_completion.result(60)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_async_save_without_a_stager_or_with_dcps_process_executor_is_dcps_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(state_dict_saver, "async_save", lambda s, **kw: calls.append(kw) or "dcp")
    assert dcp_compat.dcp_async_save({"w": torch.ones(1)}, checkpoint_id="a") == "dcp"
    process = state_dict_saver.AsyncCheckpointerType.PROCESS
    with BudgetedStager() as stager:
        kwargs = {"async_stager": stager, "async_checkpointer_type": process}
        assert dcp_compat.dcp_async_save({"w": torch.ones(1)}, **kwargs) == "dcp"
    assert [sorted(kw) for kw in calls] == [["checkpoint_id"], sorted(kwargs)]
